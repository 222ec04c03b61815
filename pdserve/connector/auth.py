"""The cluster token's one use: an HMAC-SHA256 that proves a peer knows it.

The side channel signs every frame with it and the tcp transport signs a fresh challenge on
each data connection; both go through these two functions.
"""

from __future__ import annotations

import hashlib
import hmac


def sign(token: str, payload: bytes) -> bytes:
    """HMAC-SHA256 of ``payload`` under ``token``."""
    return hmac.new(token.encode(), payload, hashlib.sha256).digest()


def verify(token: str, payload: bytes, mac: object) -> bool:
    """True when ``mac`` is ``payload``'s signature under ``token`` (in constant time)."""
    return isinstance(mac, bytes) and hmac.compare_digest(mac, sign(token, payload))
