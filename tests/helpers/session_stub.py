"""An engine stub whose ``Session`` returns a call the test scripted: the router's end of a
session (``EngineSession``) driven without an engine."""

from __future__ import annotations

from typing import Any


class SessionStub:
    def __init__(self, call: Any) -> None:
        self.call = call

    def Session(self, requests: Any) -> Any:  # noqa: N802 (gRPC's method name)
        return self.call
