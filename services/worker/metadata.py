"""The worker's self-description (GET /v1/metadata), built in one place.

Routers use it to register and place workers; the KV-transfer issue adds its fields here
(transfer mode, KV address, compatibility hash).
"""

from __future__ import annotations

from typing import Any

from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient


def build_metadata(config: WorkerConfig, engine: EngineClient, in_flight: int) -> dict[str, Any]:
    stats = engine.stats()
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
        },
        "load": {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "admitted_sequences": in_flight,
        },
        "prefix_caching": config.engine.enable_prefix_caching,
    }
