"""The KV-transfer service of a prefill or decode worker, next to its engine.

Started once the engine has loaded (the service needs the cache tensor, the weights
fingerprint and the model geometry) and closed before the engine shuts down, because closing
releases every lease still held, through the engine. The KV app listens on its own port
(`--kv-port`, 0 = ephemeral); the port actually bound is what metadata and
kv_transfer_params publish. The service's engine id is the engine's own id, so one id names
the worker in /v1/metadata, in kv_transfer_params and in handshakes.

Expired leases are reaped after every engine step (a step listener on the event loop), so a
lease that ran out frees its blocks before the scheduler's next decision; the service's
timer remains the backstop while the engine is idle (no steps).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from services.kv_transfer.app import start_server
from services.kv_transfer.service import KVTransferService
from services.kv_transfer.store import EngineBlockStore
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient
from shared.engine.kv_spec import kv_spec_of

log = logging.getLogger(__name__)


@dataclass
class KVLink:
    """A running KV service, its block store over the engine, and its server."""

    service: KVTransferService
    store: EngineBlockStore
    runner: web.AppRunner
    detach_steps: Callable[[], None] | None = None

    @classmethod
    async def start(cls, config: WorkerConfig, engine: EngineClient,
                    registry: CollectorRegistry) -> KVLink:
        """Build the service over `engine` (already started) and start serving /kv/v1/."""
        assert config.kv is not None, "only prefill and decode workers have a KV link"
        kv_config = dataclasses.replace(config.kv, engine_id=engine.engine_id)
        connector = engine.kv_connector
        store = EngineBlockStore(connector, await connector.cache_view())
        # The served name (what clients and routers call the model) identifies it: paths to
        # the same weights differ between hosts, the fingerprint catches different weights
        # and the transforms what this worker does to them (quantisation).
        spec = kv_spec_of(config.served_model_name, engine.fingerprint, config.engine,
                          engine.model_config)
        service = KVTransferService(kv_config, spec, store, registry)
        runner = await start_server(kv_config, service)
        node = service.identity.node
        log.info("KV transfer (%s, %s mode) on %s:%d, compat hash %s", node.role,
                 node.transfer_mode, config.kv.host, node.kv_port, service.identity.compat_hash)
        # Expired leases are reaped after every engine step (the service's timer is the
        # backstop while the engine is idle).
        return cls(service, store, runner, connector.add_step_listener(service.transfer.reap))

    async def close(self) -> None:
        """Stop the KV app; its cleanup releases every lease (needs the engine still up)."""
        if self.detach_steps is not None:
            self.detach_steps()
        await self.runner.cleanup()

    def metadata(self) -> dict[str, Any]:
        """The fields a router pairs workers on (merged into GET /v1/metadata)."""
        ident = self.service.identity
        node = ident.node
        transfer = self.service.transfer
        cfg = self.service.config
        return {
            "compat_hash": ident.compat_hash,
            "compat_factors": ident.factors.to_wire(),
            "transfer_mode": node.transfer_mode,
            "kv_host": node.kv_host,
            "kv_port": node.kv_port,
            # `tls`: the KV listener serves TLS (a router tells push decodes to use https).
            "kv_endpoint": {"host": node.kv_host, "port": node.kv_port, "tls": cfg.tls.enabled},
            "kv_transfer": {
                "engine_id": node.engine_id,
                "role": node.role,
                "mode": node.transfer_mode,
                "lease_seconds": cfg.lease_seconds,
                "push_deadline_seconds": cfg.push_deadline_seconds,
                "held_blocks": transfer.held_blocks,
                "oldest_lease_age_seconds": transfer.oldest_age(),
                "auth": cfg.secret is not None,
                "pp_size": node.pp_size,
                "layer_ranges": [list(r) for r in node.stage_ranges],
            },
        }

