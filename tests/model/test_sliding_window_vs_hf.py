"""Sliding-window models (Mistral, Qwen3 with mixed layers, Phi-3) against HF transformers
(fp32) on random checkpoints whose window (5) is far shorter than the prompts. (Qwen2 runs
against HF through the engine: tests/engine/test_engine_sliding_window.py.)

Chunked prefill, single-token decode and mixed batches run through a paged cache with
block_size 4 and scrambled block tables (the plain-torch path), and must reproduce HF's
logits, which HF computes with its own sliding-window causal mask.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.model.loader import load_model
from tests.support.model import PagedRunner, random_ids

ATOL, RTOL = 1e-4, 1e-5
WINDOW = 5
CASES: dict[str, dict[str, object]] = {
    "mistral": {"arch": "mistral", "tie_word_embeddings": False},
    # layer 0 full, layer 1 slides
    "qwen3_mixed": {"arch": "qwen3", "max_window_layers": 1, "tie_word_embeddings": False},
    "phi3": {"arch": "phi3", "tie_word_embeddings": False},
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, make_checkpoint):
    path = make_checkpoint(sliding_window=WINDOW, **CASES[request.param])
    ours, cfg = load_model(path, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, cfg


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_layer_windows_come_from_the_config(pair) -> None:
    _, hf, cfg = pair
    expected = [WINDOW if t == "sliding_attention" else None
                for t in getattr(hf.config, "layer_types", None) or ["sliding_attention"] * 2]
    assert list(cfg.layer_windows) == expected and WINDOW in expected


def test_chunked_prefill_then_decode_matches_hf(pair) -> None:
    ours, hf, _ = pair
    ids = random_ids(30, seed=1)
    runner = PagedRunner(ours)
    got = torch.cat([
        runner.step([("a", ids[:11])])["a"],  # a chunk longer than the window
        runner.step([("a", ids[11:14])])["a"],  # a chunk shorter than it
        *(runner.step([("a", [t])])["a"] for t in ids[14:]),
    ])
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_mixed_batch_matches_hf(pair) -> None:
    ours, hf, _ = pair
    seqs = {"x": random_ids(23, seed=2), "y": random_ids(4, seed=3), "z": random_ids(17, seed=4)}
    runner = PagedRunner(ours)
    runner.step([("x", seqs["x"][:12]), ("y", seqs["y"][:3])])
    out = runner.step([("y", seqs["y"][3:]), ("x", seqs["x"][12:]), ("z", seqs["z"])])
    for seq, ids in seqs.items():
        n = len(out[seq])
        torch.testing.assert_close(out[seq], _hf_logits(hf, ids)[-n:], atol=ATOL, rtol=RTOL)
