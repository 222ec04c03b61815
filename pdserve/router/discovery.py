"""Where the router's engines are: static ``host:port`` entries, and ``dns:NAME:PORT`` entries
that stand for every address NAME resolves to (A and AAAA records), looked up again every few
seconds. A Kubernetes headless Service answers with one address per ready pod, so engines that
are scaled up, rescheduled or rolled join and leave the pool without a router restart.

The lookups use dnspython's asyncio resolver (the system's resolv.conf with its search domains,
as a pod has it, or a given nameserver). A failed lookup (timeout, no nameserver) keeps the
addresses already known: a DNS hiccup must not empty the pool. A name that no longer exists, or
has no address, does empty its share of it.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:"
DNS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class EngineSource:
    """One ``--prefill`` / ``--decode`` entry."""

    role: str
    host: str
    port: int
    dns: bool  # True: every address ``host`` resolves to; False: this one address

    @classmethod
    def parse(cls, role: str, spec: str) -> EngineSource:
        """``host:port``, ``[v6]:port`` or ``dns:NAME:PORT``; ValueError names the bad entry."""
        dns_entry = spec.startswith(DNS_PREFIX)
        rest = spec[len(DNS_PREFIX) :] if dns_entry else spec
        host, sep, port = rest.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            form = "dns:NAME:PORT" if dns_entry else "HOST:PORT or dns:NAME:PORT"
            raise ValueError(f"--{role} entry {spec!r}: expected {form}")
        return cls(role, host, int(port), dns_entry)

    def static_address(self) -> str:
        return grpc_address(self.host, self.port)


def address_host(address: str) -> str:
    """The host of a gRPC ``host:port`` target, without the brackets of an IPv6 literal (the
    inverse of ``grpc_address``)."""
    return address.rpartition(":")[0].strip("[]")


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as a gRPC target (IPv6 literals in brackets)."""
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


class Resolver:
    """A and AAAA lookups; ``nameserver`` ``HOST:PORT`` overrides the system's resolv.conf."""

    def __init__(self, nameserver: str | None = None) -> None:
        if nameserver:
            host, _, port = nameserver.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--dns-server {nameserver!r}: expected HOST:PORT")
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [host.strip("[]")]
            self._resolver.port = int(port)
        else:
            self._resolver = dns.asyncresolver.Resolver()
        self._resolver.lifetime = DNS_TIMEOUT_S

    async def addresses(self, name: str) -> set[str] | None:
        """Every address of ``name``; an empty set if it has none or does not exist; None when
        the lookup itself failed (the caller keeps what it had)."""
        found: set[str] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(name, rdtype, search=True, raise_on_no_answer=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.resolver.YXDOMAIN) as exc:
                logger.warning("DNS lookup of %s (%s) failed: %s", name, rdtype, exc)
                return None
            found.update(record.address for record in answer.rrset or ())
        return found
