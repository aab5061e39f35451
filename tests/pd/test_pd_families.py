"""Every model family through P/D: pull and push give the mixed worker's tokens, greedy.

One tiny random checkpoint per family beyond Llama (whose P/D runs are test_pd_invariant.py);
the family's own HF parity is tests/model/test_llama_vs_hf.py. Prompts cross block boundaries
so the transferred KV spans several blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from services.worker.parsers_config import ParsersConfig
from shared.model.make_model import VOCAB_SIZE, ModelSpec, write_checkpoint
from shared.model.registry import resolve_model
from tests.support.gpt_oss_ckpt import write_gpt_oss
from tests.support.pd import dispatch_pull, dispatch_push, metadata, post, settle_to_zero
from tests.support.pd_mesh import MODEL, worker_config
from tests.support.worker import WorkerThread, start_workers, stop_all

FAMILIES = {
    # QK-norm and a head_dim (24) that is not hidden / heads (16).
    "qwen3": ModelSpec(arch="qwen3", preset="tiny", tie_word_embeddings=False, head_dim=24,
                       seed=5, max_position_embeddings=2304),
    # Fused qkv_proj/gate_up_proj in the checkpoint; Phi-4-mini's partial rotary.
    "phi3": ModelSpec(arch="phi3", preset="tiny", tie_word_embeddings=False, seed=5,
                      max_position_embeddings=2304, partial_rotary_factor=0.75),
    # Every layer slides over 8 positions: the decode drops blocks the prefill sent whole.
    "mistral_sliding": ModelSpec(arch="mistral", preset="tiny", tie_word_embeddings=False,
                                 seed=5, max_position_embeddings=2304, sliding_window=8),
    # Routed experts on layer 1, a dense MLP on layer 0.
    "qwen3_moe": ModelSpec(arch="qwen3_moe", preset="tiny", tie_word_embeddings=False, seed=5,
                           max_position_embeddings=2304, mlp_only_layers=(0,)),
    # Sandwich norms, soft-caps, sliding layers (window 8) and a local RoPE base.
    "gemma2": ModelSpec(arch="gemma2", preset="tiny", seed=5, max_position_embeddings=2304),
    "gemma3": ModelSpec(arch="gemma3_text", preset="tiny", tie_word_embeddings=False, seed=5,
                        max_position_embeddings=2304),
}
COMPLETIONS = "/v1/completions"


# gpt-oss (sinks, experts with biases, alternating windows, YaRN) is written by HF itself.
GPT_OSS = "gpt_oss"


def _checkpoint(name: str, out: Path, tokenizer_dir: Path) -> Path:
    if name == GPT_OSS:
        return write_gpt_oss(out, seed=5, vocab_size=VOCAB_SIZE, tokenizer_dir=tokenizer_dir, max_position_embeddings=2304)
    return write_checkpoint(out, FAMILIES[name], tokenizer_dir)


@pytest.fixture(scope="module", params=[*FAMILIES, GPT_OSS])
def family_mesh(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerThread]]:
    tokenizer_dir = resolve_model("smollm2-135m-instruct", progress=False)
    ckpt = _checkpoint(request.param, tmp_path_factory.mktemp(f"pd-{request.param}"),
                       tokenizer_dir)
    # A gpt-oss worker renders chat through harmony, whose o200k vocabulary a SmolLM2
    # tokenizer is not: it is given OpenAI's file (these tests use /v1/completions).
    parsers = (ParsersConfig(harmony_vocab=request.getfixturevalue("harmony_vocab_dir"))
               if request.param == GPT_OSS else None)
    workers = start_workers({
        "mixed": worker_config(ckpt, "mixed", parsers=parsers),
        "prefill": worker_config(ckpt, "prefill", parsers=parsers),
        "decode": worker_config(ckpt, "decode", parsers=parsers),
        "push_prefill": worker_config(ckpt, "prefill", "push", parsers=parsers),
        "push_decode": worker_config(ckpt, "decode", "push", parsers=parsers),
    })
    try:
        yield workers
    finally:
        stop_all(workers)


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_pd_equals_mixed(family_mesh: dict[str, WorkerThread], mode: str) -> None:
    w = family_mesh
    prefill, decode = (w["prefill"], w["decode"]) if mode == "pull" else (w["push_prefill"],
                                                                          w["push_decode"])
    async with aiohttp.ClientSession() as s:
        for length in (1, 17, 70):
            prompt = [(97 * i + length) % 40000 + 100 for i in range(length)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            ref = await post(s, w["mixed"].url + COMPLETIONS, body)
            assert ref.status == 200, ref.body
            if mode == "pull":
                got = await dispatch_pull(s, prefill.url, decode.url, COMPLETIONS, body)
            else:
                meta = await metadata(s, prefill.url)
                got = await dispatch_push(s, prefill.url, decode.url, COMPLETIONS, body, meta)
            assert got.status == 200, got.body
            assert got.token_ids == ref.token_ids, (mode, length)
            assert got.phases["kv_recomputed"] is False and got.phases["kv_bytes"] > 0
        await settle_to_zero(s, prefill.url, decode.url)
