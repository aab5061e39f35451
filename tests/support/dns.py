"""A resolver for the router's dns:// discovery whose answers the test sets (standard library
only). It fails like getaddrinfo: an unknown name is NXDOMAIN (EAI_NONAME)."""

from __future__ import annotations

import socket


class FakeResolver:
    """`names[host]` is the address list `host` resolves to now; `failure`, if set, is raised
    instead (e.g. a resolver timeout). `calls` counts lookups."""

    def __init__(self, names: dict[str, list[str]] | None = None) -> None:
        self.names: dict[str, list[str]] = dict(names or {})
        self.failure: OSError | None = None
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if self.failure is not None:
            raise self.failure
        if host not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.names[host])
