"""`--discover k8s://NAMESPACE/SERVICE[:PORT]`: workers from a Service's EndpointSlices.

List the slices labelled `kubernetes.io/service-name=SERVICE`, then watch from the list's
resourceVersion (ADDED / MODIFIED / DELETED events; BOOKMARKs only move the version), and hand
the ready endpoints to `DiscoveredWorkers` after every event: a pod that turns ready joins
(after its health check), one that turns not ready or goes away drains. When the watch ends
(the server's timeout, 410 Gone after compaction, a dropped connection) the watcher lists
again, so it never acts on a stale view; other failures are retried with a capped backoff and
keep the workers already known.

This module imports kubernetes-asyncio at the top; `discovery.py` imports it only when a k8s://
target is configured. Credentials: a kubeconfig file if one is configured, else the pod's
service account (in-cluster config).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from services.router.config import DiscoveryScheme, DiscoveryTarget
from services.router.discovery import DiscoveredWorkers, worker_url

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 240  # the server ends each watch after this; we list again (cheap, exact)
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 30.0


def slice_port(endpoint_slice: Any, target: DiscoveryTarget) -> int | None:
    """The workers' port in one slice: the target's number, the port of the target's name,
    or the slice's only port; None when the slice has no such port."""
    ports = endpoint_slice.ports or []
    if target.port_name is not None:
        return next((p.port for p in ports if p.name == target.port_name), None)
    if target.port is not None:
        return target.port
    return ports[0].port if len(ports) == 1 else None


def ready_urls(slices: Iterable[Any], target: DiscoveryTarget) -> set[str]:
    """One URL per ready endpoint address. `conditions.ready` unset counts as ready, as the
    EndpointSlice API asks of consumers; a terminating pod is reported not ready."""
    urls: set[str] = set()
    for endpoint_slice in slices:
        port = slice_port(endpoint_slice, target)
        if port is None:
            continue
        for endpoint in endpoint_slice.endpoints or []:
            conditions = endpoint.conditions
            if conditions is not None and conditions.ready is False:
                continue
            urls.update(worker_url(address, port) for address in endpoint.addresses or [])
    return urls


class EndpointSliceWatcher:
    """Watches one k8s:// target until cancelled."""

    def __init__(self, target: DiscoveryTarget, members: DiscoveredWorkers,
                 kubeconfig: str | None) -> None:
        assert target.scheme is DiscoveryScheme.K8S
        self._target = target
        self._members = members
        self._kubeconfig = kubeconfig
        self._selector = f"kubernetes.io/service-name={target.service}"
        self._slices: dict[str, Any] = {}

    async def _api_client(self) -> client.ApiClient:
        configuration = client.Configuration()
        if self._kubeconfig:
            await config.load_kube_config(config_file=self._kubeconfig,
                                          client_configuration=configuration,
                                          persist_config=False)
        else:
            config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration=configuration)

    async def run(self) -> None:
        delay = RETRY_INITIAL_S
        while True:
            try:
                api_client = await self._api_client()
            except Exception as exc:  # no kubeconfig, not in a cluster: say so, try again
                self._members.failed(self._target, f"kubernetes client config: {exc}")
                await asyncio.sleep(RETRY_MAX_S)
                continue
            try:
                api = client.DiscoveryV1Api(api_client)
                while True:
                    await self._list_and_watch(api)
                    delay = RETRY_INITIAL_S
            except ApiException as exc:
                if exc.status == 410:  # our version was compacted away: list again at once
                    log.debug("%s: watch expired (410), listing again", self._target.uri)
                    continue
                self._members.failed(self._target, f"EndpointSlice API: {exc.status} "
                                     f"{exc.reason}")
            except Exception as exc:  # connection refused or dropped, bad answer...
                self._members.failed(self._target, f"EndpointSlice API: {exc!r}")
            finally:
                await api_client.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _list_and_watch(self, api: client.DiscoveryV1Api) -> None:
        """One list, then one watch from its version until the server ends it."""
        namespace = self._target.namespace
        listing = await api.list_namespaced_endpoint_slice(namespace,
                                                           label_selector=self._selector)
        self._slices = {s.metadata.name: s for s in listing.items}
        self._publish()
        async with watch.Watch() as stream:
            events = stream.stream(api.list_namespaced_endpoint_slice, namespace,
                                   label_selector=self._selector,
                                   resource_version=listing.metadata.resource_version,
                                   allow_watch_bookmarks=True, timeout_seconds=WATCH_TIMEOUT_S,
                                   _request_timeout=WATCH_TIMEOUT_S + 30)
            async for event in events:
                if self._apply(event):
                    self._publish()

    def _apply(self, event: Mapping[str, Any]) -> bool:
        """Fold one watch event into the slices; False for events that change nothing."""
        kind, obj = event["type"], event["object"]
        if kind in ("ADDED", "MODIFIED"):
            self._slices[obj.metadata.name] = obj
        elif kind == "DELETED":
            self._slices.pop(obj.metadata.name, None)
        else:  # BOOKMARK: the watch library already took its resourceVersion
            return False
        return True

    def _publish(self) -> None:
        note = None if self._slices else f"no EndpointSlice for service {self._target.service}"
        portless = sorted(name for name, s in self._slices.items()
                          if slice_port(s, self._target) is None)
        if portless:  # a wrong port name, or several ports and none chosen
            note = (f"EndpointSlice(s) {', '.join(portless)} have no port "
                    f"{self._target.port_name or '(several: name one in the URL)'}")
        self._members.update(self._target, ready_urls(self._slices.values(), self._target),
                             note=note)
