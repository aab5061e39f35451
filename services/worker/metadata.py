"""The worker's self-description (GET /v1/metadata), built in one place.

Routers use it to register, pair and place workers. A prefill or decode worker adds its KV
side (`KVLink.metadata`): compat_hash, compat_factors, transfer_mode, the KV address; a mixed
worker reports those as null (it never exchanges KV). `engine_id` is also the KV service's
engine id. `kv_cache.num_held_blocks` counts blocks the engine keeps for a peer. `kernels` is
the kernel ladder as this process runs it (shared.kernel_tiers): the CPU's tier, the cap, each
library's active tier and backend, and the configured `kernel_tier` ("requested").
`memory` gives the bytes of the model's tensors and of the KV cache.
`parsers` names the tool-call and reasoning parsers its chat output is read with (a router
must not stream raw text ahead of a worker that parses it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient
from shared.kernel_tiers import kernel_tiers

if TYPE_CHECKING:
    from services.worker.kv_link import KVLink


def build_metadata(config: WorkerConfig, engine: EngineClient, in_flight: int,
                   kv_link: KVLink | None = None) -> dict[str, Any]:
    stats = engine.stats()
    kv = kv_link.metadata() if kv_link is not None else {
        "compat_hash": None, "compat_factors": None, "transfer_mode": None}
    return {
        "role": config.role.value,
        "engine_id": engine.engine_id,
        "model": {
            "id": config.served_model_name,
            "names": list(config.model_names),
            "source": config.engine.model,
            "fingerprint": engine.fingerprint,
        },
        "dtype": config.engine.dtype,
        "kv_cache_dtype": config.engine.resolved_kv_dtype,
        "max_model_len": engine.max_model_len,
        "block_size": stats.block_size,
        "kv_cache": {
            "num_total_blocks": stats.num_total_blocks,
            "num_free_blocks": stats.num_free_blocks,
            "num_used_blocks": stats.num_total_blocks - stats.num_free_blocks,
            "usage": stats.kv_usage,
            "capacity_tokens": stats.num_total_blocks * stats.block_size,
            "num_held_blocks": getattr(stats, "num_held_blocks", 0),
        },
        # Bytes the engine allocated; a process's RSS adds the Python/torch runtime to these
        # (benchmarks/memory.py measures both).
        "memory": {"weights_bytes": stats.weights_bytes, "kv_cache_bytes": stats.kv_cache_bytes},
        "load": {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "admitted_sequences": in_flight,
        },
        "prefix_caching": config.engine.enable_prefix_caching,
        "kernels": {**kernel_tiers().to_dict(), "requested": config.engine.kernel_tier},
        "parsers": config.parsers.describe(),
        **kv,
    }
