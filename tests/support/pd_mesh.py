"""The shared P/D test topology: model, worker configurations, and who plays which part."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.cli import main as pdmesh
from services.kv_transfer.config import KVTransferConfig
from services.worker.config import KVLoadFailurePolicy, WorkerConfig
from services.worker.parsers_config import ParsersConfig
from shared.config import EngineConfig
from shared.protocol.pd import Role
from tests.support.worker import SubprocessWorker, WorkerThread

MODEL = "tiny"
SHORT_LEASE_S = 2.0
KILL_LEASE_S = 2.0


def make_model(out: Path, seed: int) -> Path:
    # Untied embeddings: with tied ones the random model repeats one token whatever the KV.
    assert pdmesh(["make-model", str(out), "--preset", "tiny", "--seed", str(seed),
                   "--untied", "--max-position-embeddings", "2304"]) == 0
    return out


def engine_config(model: Path, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {"model": str(model), "dtype": "float32",
                              "kv_cache_memory_bytes": 16 << 20, "max_num_seqs": 32,
                              "num_threads": 1, **overrides}
    return EngineConfig(**values)


def worker_config(model: Path, role: str, mode: str = "pull", *, lease: float = 30.0,
                  policy: KVLoadFailurePolicy = KVLoadFailurePolicy.FAIL,
                  secret: bytes | None = None, parsers: ParsersConfig | None = None,
                  **engine: Any) -> WorkerConfig:
    kv = None if role == "mixed" else KVTransferConfig(
        role=role, mode=mode, port=0, lease_seconds=lease, push_deadline_seconds=5.0,
        secret=secret)
    return WorkerConfig(engine=engine_config(model, **engine), role=Role(role), kv=kv,
                        served_model_names=(MODEL,), kv_load_failure_policy=policy,
                        parsers=parsers or ParsersConfig())


@dataclass
class Mesh:
    """The shared in-process workers, by part."""

    mixed: WorkerThread
    prefill: WorkerThread  # pull
    decode: WorkerThread  # pull
    push_prefill: WorkerThread
    push_decode: WorkerThread
    short_lease_prefill: WorkerThread  # pull, SHORT_LEASE_S lease
    recompute_decode: WorkerThread  # pull, --kv-load-failure-policy recompute
    other_decode: WorkerThread  # pull, other weights

    @property
    def kv_workers(self) -> list[WorkerThread]:
        return [w for w in vars(self).values() if w is not self.mixed]


@dataclass
class ProcessPair:
    """`pdmesh serve` processes: a pull prefill (short lease) and a pull decode."""

    prefill: SubprocessWorker
    decode: SubprocessWorker


def serve_args(model: Path, role: str, *extra: str) -> list[str]:
    # fp32, as the in-process workers (EngineConfig's default): the CLI's `--dtype auto` is
    # bf16 on a CPU with a native tier, and a bf16 worker never pairs with an fp32 one.
    return ["--model", str(model), "--served-model-name", MODEL, "--role", role,
            "--transfer-mode", "pull", "--kv-port", "0", "--kv-cache-memory", "16MiB",
            "--threads", "1", "--dtype", "float32", *extra]
