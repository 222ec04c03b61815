"""A DNS zone the tests edit, served by dnslib on a loopback port: the headless Services of
``dns:NAME:PORT`` discovery."""

from __future__ import annotations

import threading

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver


class Zone(BaseResolver):
    """A-record answers the test edits: {name: [ip, ...]}; unknown names are NXDOMAIN."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def set(self, name: str, ips: list[str]) -> None:
        with self.lock:
            self.records[name] = list(ips)

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        with self.lock:
            ips = self.records.get(name)
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for ip in ips:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=0))
        return reply
