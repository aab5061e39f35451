"""A fake Kubernetes API server for discovery.k8s.io/v1 EndpointSlices, speaking the real
list + watch protocol, so the router's watcher runs the real kubernetes-asyncio client.

- `GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=k=v` answers an
  `EndpointSliceList` whose `metadata.resourceVersion` is the store's version now.
- The same path with `watch=true&resourceVersion=RV` streams newline-delimited JSON events
  (`ADDED`, `MODIFIED`, `DELETED`; `BOOKMARK` if `allowWatchBookmarks`) for every change after
  RV, then waits for more until `timeoutSeconds` (or `end_watches()`), and ends the stream.
- After `expire_next_watch()`, the next watch gets what the server answers a version that
  compaction removed: one `ERROR` event carrying a 410 `Expired` Status.
- Every request needs `Authorization: Bearer <token>` (401 Status otherwise).

`kubeconfig()` writes a kubeconfig that points the client at this server.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

GROUP_VERSION = "discovery.k8s.io/v1"
SERVICE_LABEL = "kubernetes.io/service-name"
_TRUE = {"1", "t", "T", "true", "TRUE", "True"}  # what the API server's ParseBool accepts


@dataclass(frozen=True)
class Endpoint:
    address: str
    ready: bool | None = True  # None: the condition is unset


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _matches(obj: dict[str, Any], selector: str) -> bool:
    """Equality-based label selectors (`a=b,c=d`), the only kind the watcher sends."""
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value.lstrip("="):
            return False
    return True


class FakeKubeApi:
    """The EndpointSlices of every namespace, versioned like etcd: one counter for all."""

    def __init__(self, token: str = "fake-token") -> None:
        self.token = token
        self._rv = 100
        self._slices: dict[tuple[str, str], dict[str, Any]] = {}
        self._events: list[tuple[int, str, str, dict[str, Any]]] = []  # rv, ns, type, object
        self._expire_next = False
        self.expired = 0  # watches answered 410
        self._epoch = 0  # end_watches() bumps it: open watches end
        self._changed = asyncio.Condition()
        self.requests: list[dict[str, str]] = []  # query of every list/watch call
        self.open_watches = 0
        self.server: TestServer | None = None

    # -- the test's side ------------------------------------------------------------------
    async def start(self) -> FakeKubeApi:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                           self._handle)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def close(self) -> None:
        await self.end_watches()
        if self.server is not None:
            await self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        path.write_text(json.dumps({  # JSON is YAML
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": namespace}}]}))
        return path

    async def put(self, namespace: str, name: str, service: str, endpoints: list[Endpoint],
                  port: int, port_name: str | None = "http") -> None:
        """Create (ADDED) or replace (MODIFIED) one slice."""
        kind = "MODIFIED" if (namespace, name) in self._slices else "ADDED"
        port_doc: dict[str, Any] = {"port": port, "protocol": "TCP"}
        if port_name is not None:
            port_doc["name"] = port_name
        obj = {"kind": "EndpointSlice", "apiVersion": GROUP_VERSION, "addressType": "IPv4",
               "metadata": {"name": name, "namespace": namespace,
                            "labels": {SERVICE_LABEL: service}},
               "endpoints": [self._endpoint(e) for e in endpoints], "ports": [port_doc]}
        await self._record(namespace, kind, obj)
        self._slices[(namespace, name)] = obj

    async def delete(self, namespace: str, name: str) -> None:
        obj = self._slices.pop((namespace, name))
        await self._record(namespace, "DELETED", obj)

    async def bookmark(self) -> None:
        """A BOOKMARK to every watch that allows them: the version moves, nothing changes."""
        self._rv += 1
        obj = {"kind": "EndpointSlice", "apiVersion": GROUP_VERSION,
               "metadata": {"resourceVersion": str(self._rv)}}
        self._events.append((self._rv, "*", "BOOKMARK", obj))
        await self._notify()

    def expire_next_watch(self) -> None:
        """The next watch's version is reported compacted away (410 Expired)."""
        self._expire_next = True

    async def end_watches(self) -> None:
        """End every open watch, as the server's timeout does."""
        self._epoch += 1
        await self._notify()

    # -- the server's side ----------------------------------------------------------------
    @staticmethod
    def _endpoint(e: Endpoint) -> dict[str, Any]:
        conditions = {} if e.ready is None else {"ready": e.ready}
        return {"addresses": [e.address], "conditions": conditions}

    async def _record(self, namespace: str, kind: str, obj: dict[str, Any]) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._events.append((self._rv, namespace, kind, json.loads(json.dumps(obj))))
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(query)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        namespace, selector = request.match_info["ns"], query.get("labelSelector", "")
        if query.get("watch") in _TRUE:
            return await self._watch(request, namespace, selector, query)
        items = [o for (ns, _), o in sorted(self._slices.items())
                 if ns == namespace and _matches(o, selector)]
        return web.json_response({"kind": "EndpointSliceList", "apiVersion": GROUP_VERSION,
                                  "metadata": {"resourceVersion": str(self._rv)},
                                  "items": items})

    async def _watch(self, request: web.Request, namespace: str, selector: str,
                     query: dict[str, str]) -> web.StreamResponse:
        since = int(query.get("resourceVersion") or self._rv)
        bookmarks = query.get("allowWatchBookmarks") in _TRUE
        timeout = float(query.get("timeoutSeconds") or 1800)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if self._expire_next:
            self._expire_next, self.expired = False, self.expired + 1
            error = _status(410, "Expired", f"too old resource version: {since} ({self._rv})")
            await resp.write(json.dumps({"type": "ERROR", "object": error}).encode() + b"\n")
            return resp
        epoch, loop = self._epoch, asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.open_watches += 1
        try:
            while self._epoch == epoch and loop.time() < deadline:
                for rv, ns, kind, obj in self._events:
                    if rv <= since:
                        continue
                    since = rv
                    if kind == "BOOKMARK" and bookmarks or (
                            kind != "BOOKMARK" and ns == namespace and _matches(obj, selector)):
                        line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                        await resp.write(line)
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait(),
                                               max(0.0, deadline - loop.time()))
                    except TimeoutError:
                        break
        finally:
            self.open_watches -= 1
        return resp
