"""Test helpers: KV services on 127.0.0.1 with in-memory block stores of the real layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import aiohttp
import torch
from aiohttp import web
from prometheus_client import CollectorRegistry

from services.kv_transfer.app import start_server
from services.kv_transfer.config import KVTransferConfig
from services.kv_transfer.service import KVTransferService
from services.kv_transfer.store import InMemoryBlockStore, block_major
from shared.protocol.compat import ModelKVSpec
from shared.protocol.messages import TokenLogprobWire

SECRET = b"0123456789abcdef-test-secret"


def small_spec(**overrides: object) -> ModelKVSpec:
    base = ModelKVSpec(
        model_id="tiny-llama", weights_fingerprint="w" * 64, dtype="bfloat16",
        kv_dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=8,
        rope=ModelKVSpec.rope_items({"rope_theta": 10000.0, "rope_type": "default"}),
    )
    return dataclasses.replace(base, **overrides)


@dataclass
class Node:
    """One worker's KV side: its service, in-memory store, runner, metrics registry."""

    service: KVTransferService
    store: InMemoryBlockStore
    runner: web.AppRunner
    registry: CollectorRegistry

    @property
    def address(self) -> str:
        return self.service.identity.node.address

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


async def start_node(role: str, mode: str = "pull", *, spec: ModelKVSpec | None = None,
                     block_size: int = 4, num_blocks: int = 64,
                     dtype: torch.dtype = torch.bfloat16, clock=None,
                     **config: object) -> Node:
    spec = spec or small_spec()
    store = InMemoryBlockStore(spec.num_layers, num_blocks, block_size, spec.num_kv_heads,
                               spec.head_dim, dtype)
    cfg = KVTransferConfig(role=role, mode=mode, port=0, **config)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    kwargs = {"clock": clock} if clock is not None else {}
    service = KVTransferService(cfg, spec, store, registry, **kwargs)
    runner = await start_server(cfg, service)
    return Node(service, store, runner, registry)


async def prefill_request(node: Node, request_id: str, num_tokens: int,
                          seed: int = 0) -> list[int]:
    """Play the engine: allocate blocks, fill them with random KV, hold them for the request."""
    ids = await node.store.allocate(num_tokens)
    assert ids is not None
    gen = torch.Generator().manual_seed(seed)
    bm = block_major(node.store.kv_cache)
    rows = torch.randn((len(ids),) + tuple(bm.shape[1:]), generator=gen).to(bm.dtype)
    bm[torch.tensor(ids)] = rows
    node.store.hold(request_id, ids)
    return ids


def blocks_of(node: Node, ids: list[int]) -> torch.Tensor:
    """Block-major copy of blocks `ids` ([n, L, 2, bs, kvh, hd])."""
    return block_major(node.store.kv_cache)[torch.tensor(ids)].clone()


FIRST = TokenLogprobWire(token_id=42, logprob=-0.25, top_ids=[42, 7], top_logprobs=[-0.25, -1.5])


async def post_raw(url: str, body: bytes, headers: dict[str, str] | None = None
                   ) -> tuple[int, dict]:
    """POST raw bytes; returns (status, JSON error body or {})."""
    async with aiohttp.ClientSession() as s, s.post(url, data=body, headers=headers) as r:
        data = await r.read()
        if r.content_type == "application/json":
            import json

            return r.status, json.loads(data)
        return r.status, {}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and bit-identical contents (NaNs and signed zeros included)."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


async def assert_no_leaks(*nodes: Node) -> None:
    """Held and allocated blocks back to zero on every node (after reaping and draining)."""
    for _ in range(2):  # a decode's background release lands in the prefill's tasks
        for node in nodes:
            node.service.transfer.reap()
            await node.service.ctx.drain()
    for node in nodes:
        assert node.store.blocks_in_use == 0, node.service.identity.node.role
        assert node.service.transfer.held_blocks == 0
        assert node.metric("pdmesh:kv_held_blocks") == 0


BIG = {"spec": small_spec(num_layers=4, num_kv_heads=4, head_dim=64), "block_size": 16,
       "max_chunk_bytes": 4096}  # 64 KiB blocks, each written in 16 pieces


async def pair(nodes, **options) -> tuple[Node, Node]:  # nodes: the kv_transfer fixture
    """A push-mode prefill and decode, both with `options`."""
    return await nodes("prefill", "push", **options), await nodes("decode", "push", **options)
