"""Benchmark configuration: one frozen BenchConfig, built once by the CLI and passed down.

The parse_* helpers turn flag strings into typed values and raise ValueError on bad input, so
argparse can use them as `type=` callables and report a clean usage error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from shared.protocol.pd import ApiKind

GOODPUT_KEYS = ("ttft", "tpot", "e2el")


class DatasetKind(Enum):
    RANDOM = "random"
    PREFIX_REPETITION = "prefix-repetition"
    JSONL = "jsonl"


class PromptFormat(Enum):
    """How prompts go on the wire. AUTO: token ids for /v1/completions, text for chat."""

    AUTO = "auto"
    IDS = "ids"
    TEXT = "text"


@dataclass(frozen=True)
class DatasetSpec:
    kind: DatasetKind
    path: Path | None = None  # only for JSONL


@dataclass(frozen=True)
class BenchConfig:
    """Everything one `pdmesh bench` run needs.

    Times are in the units the flags use: goodput SLOs in milliseconds, request_rate in
    requests per second (math.inf sends everything at once). num_prompts None means "all the
    lines" for a JSONL dataset and 1000 (vLLM's default) otherwise.
    """

    base_url: str
    model: str
    endpoint: ApiKind = ApiKind.COMPLETIONS  # the OpenAI route the load goes to (streamed)
    dataset: DatasetSpec = field(default_factory=lambda: DatasetSpec(DatasetKind.RANDOM))
    input_len: int = 1024
    output_len: int = 128
    num_prompts: int | None = None
    prefix_len: int = 256
    num_prefixes: int = 10
    prompt_format: PromptFormat = PromptFormat.AUTO
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    ignore_eos: bool = False
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (99.0,)
    save_result: Path | None = None
    plot: Path | None = None
    api_key: str | None = None
    tokenizer_model: str | None = None
    extra_body: dict[str, object] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    progress: bool = True
    cpu_warn_percent: float = 50.0

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 or inf")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        if self.dataset.kind is DatasetKind.PREFIX_REPETITION and self.num_prefixes < 1:
            raise ValueError("--num-prefixes must be >= 1")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint.path

    @property
    def wire_format(self) -> PromptFormat:
        """The resolved prompt format: never AUTO."""
        if self.prompt_format is not PromptFormat.AUTO:
            return self.prompt_format
        return PromptFormat.IDS if self.endpoint is ApiKind.COMPLETIONS else PromptFormat.TEXT


def parse_rate(text: str) -> float:
    """`inf` or a positive number of requests per second."""
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {text!r}")
    return rate


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`50,90,99` -> (50.0, 90.0, 99.0); each in (0, 100]."""
    values = tuple(float(part) for part in text.split(",") if part.strip())
    if not values or any(not 0 < v <= 100 for v in values):
        raise ValueError(f"percentiles must be numbers in (0, 100], got {text!r}")
    return values


def parse_goodput(items: list[str]) -> dict[str, float]:
    """[`ttft:500`, `tpot:50`] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds, vLLM's keys)."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"goodput SLOs look like ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        ms = float(value)
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"goodput SLO {key} must be a finite number of ms >= 0, got {value!r}")
        slos[key] = ms
    return slos


def parse_dataset(text: str) -> DatasetSpec:
    """`random`, `prefix-repetition` or `jsonl:PATH`."""
    if text.startswith("jsonl:"):
        path = Path(text.removeprefix("jsonl:"))
        if not path.is_file():
            raise ValueError(f"jsonl dataset {str(path)!r} is not a file")
        return DatasetSpec(DatasetKind.JSONL, path)
    for kind in (DatasetKind.RANDOM, DatasetKind.PREFIX_REPETITION):
        if text == kind.value:
            return DatasetSpec(kind)
    raise ValueError(f"dataset must be random, prefix-repetition or jsonl:PATH, got {text!r}")


def percentile_label(p: float) -> str:
    """vLLM's key spelling: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)
