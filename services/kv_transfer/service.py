"""KVTransferService: one per prefill/decode worker; the object a worker keeps and calls.

It picks the transfer class from the configured mode name, derives the compat factors from
that class (never from the name), checks the model spec against the cache tensor it was given,
and owns the runtime pieces: the peer client (HTTP session), heartbeats, and the reaper timer
(the backstop for an idle engine: a worker also calls `transfer.reap` after every engine step).
Its lifetime is driven by the KV app's cleanup context (`start`/`close`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import aiohttp
from prometheus_client import CollectorRegistry

from services.common.errors import ConflictError
from services.kv_transfer.config import KVTransferConfig
from services.kv_transfer.context import KVContext, KVTransfer, KVTransferMetrics
from services.kv_transfer.handshake import KVIdentity, PeerClient, PeerRegistry
from services.kv_transfer.pull import PullTransfer
from services.kv_transfer.push import PushTransfer
from services.kv_transfer.store import CacheBlocks, KVBlockStore
from shared.protocol.compat import CompatFactors, ModelKVSpec
from shared.protocol.messages import NodeInfo

log = logging.getLogger("pdmesh.kv_transfer")
TRANSFER_CLASSES: dict[str, type[KVTransfer]] = {c.mode: c for c in (PullTransfer, PushTransfer)}


def _check_spec(spec: ModelKVSpec, cache: CacheBlocks, config: KVTransferConfig) -> int:
    """The cache tensor must match what the hash claims; returns the stage's layer end."""
    geo = cache.geometry
    layer_end = config.layer_end if config.layer_end is not None else spec.num_layers
    if layer_end - config.layer_start != geo.num_layers:
        raise ValueError(f"KV cache has {geo.num_layers} layers, config says "
                         f"[{config.layer_start}, {layer_end})")
    if (spec.num_kv_heads, spec.head_dim) != (geo.num_kv_heads, geo.head_dim):
        raise ValueError(f"KV cache heads/dim {geo.num_kv_heads}/{geo.head_dim} differ from the "
                         f"model's {spec.num_kv_heads}/{spec.head_dim}")
    if spec.kv_dtype != cache.dtype_name:
        raise ValueError(f"KV cache dtype {cache.dtype_name} differs from the spec's "
                         f"{spec.kv_dtype}")
    return layer_end


def stage_ranges_of(start: int, partition: tuple[int, ...] | None) -> tuple[tuple[int, int], ...]:
    """[(start, end)] per stage from the layer counts; () means NodeInfo's even split."""
    ranges: list[tuple[int, int]] = []
    for count in partition or ():
        ranges.append((start, start + count))
        start += count
    return tuple(ranges)


def _mode_mismatch(runs: str, wanted: str) -> ConflictError:
    return ConflictError(f"this KV service runs {runs} mode, not {wanted}",
                         param="transfer_mode", code="kv_transfer_mode_mismatch")


class KVTransferService:
    """The KV service of one worker. `transfer` is the mode's class instance; `pull`/`push`
    give it typed (and fail loudly when the worker runs the other mode)."""

    def __init__(self, config: KVTransferConfig, spec: ModelKVSpec, store: KVBlockStore,
                 registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        transfer_cls = TRANSFER_CLASSES[config.mode]
        geo = CacheBlocks.of(store.kv_cache)
        layer_end = _check_spec(spec, geo, config)
        node = NodeInfo(config.engine_id, config.role, transfer_cls.mode, geo.block_size,
                        geo.num_blocks, config.layer_start, layer_end, config.pp_size,
                        config.public_host, config.port,
                        layer_ranges=stage_ranges_of(config.layer_start, config.layer_partition))
        identity = KVIdentity(node, CompatFactors.for_transfer(spec, transfer_cls))
        self.config = config
        self.metrics = KVTransferMetrics(registry)
        self.ctx = KVContext(config, identity, store, geo, self.metrics, PeerRegistry(), clock)
        self.transfer = transfer_cls(self.ctx)
        self.metrics.bind(lambda: self.transfer.held_blocks, self.transfer.oldest_age)
        self._http: aiohttp.ClientSession | None = None
        self._reaper: asyncio.Task[None] | None = None

    @property
    def identity(self) -> KVIdentity:
        return self.ctx.identity

    @property
    def pull(self) -> PullTransfer:
        """The pull mode; 409 `kv_transfer_mode_mismatch` when this service runs push (the
        one check for a peer's pull route and for the worker's own calls)."""
        if not isinstance(self.transfer, PullTransfer):
            raise _mode_mismatch(self.transfer.mode, "pull")
        return self.transfer

    @property
    def push(self) -> PushTransfer:
        """The push mode; 409 `kv_transfer_mode_mismatch` when this service runs pull."""
        if not isinstance(self.transfer, PushTransfer):
            raise _mode_mismatch(self.transfer.mode, "push")
        return self.transfer

    def release_held_soon(self, request_id: str) -> None:
        """Free the blocks the engine held for a prefill whose transfer never started, in the
        background (failures are logged; `close` waits for it)."""
        self.ctx.detach(self.ctx.store.release_held(request_id), "release held KV")

    def set_port(self, port: int) -> None:
        """Record the bound port (port 0 = ephemeral) before the service starts."""
        node = dataclasses.replace(self.ctx.identity.node, kv_port=port)
        self.ctx.identity = KVIdentity(node, self.ctx.identity.factors)

    async def start(self) -> None:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        # A read buffer of one chunk: with aiohttp's 64 KiB default the transport pauses and
        # resumes reading dozens of times per 4 MiB chunk (~15% of a pull's CPU).
        # TLS peers (https:// addresses) are verified against --tls-ca, and shown this worker's
        # certificate when they require one (mTLS); plain peers ignore the context.
        connector = aiohttp.TCPConnector(ssl=cfg.tls.client_context(),
                                         keepalive_timeout=cfg.keepalive_s)
        self._http = aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                           read_bufsize=cfg.max_chunk_bytes, connector=connector)
        self.ctx.peer_client = PeerClient(self.ctx, self._http, cfg.secret, cfg.allow_incompatible)
        await self.transfer.start()
        self._reaper = asyncio.ensure_future(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            self.transfer.reap()

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await self.transfer.close()
        await self.ctx.drain()
        if self._http is not None:
            await self._http.close()
        self.ctx.peer_client = None
        self.metrics.unbind()
