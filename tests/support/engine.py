"""Drive an LLMEngine to completion in tests, optionally adding requests mid-run."""

from __future__ import annotations

import random

import torch

from shared.engine.engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams

VOCAB = 49152


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
               late: dict[int, int] | None = None, max_steps: int = 5000,
               ) -> dict[int, RequestOutput]:
    """Run prompts[i] with params[i]; prompt i in `late` is added before step late[i].

    Returns the final output of each prompt index; checks that streamed deltas add up.
    """
    late = late or {}
    final: dict[int, RequestOutput] = {}
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    texts: dict[int, str] = {i: "" for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        if i not in late:
            engine.add_request(f"req-{i}", p, params[i])
    step = 0
    while engine.has_unfinished_requests() or any(step <= s for s in late.values()):
        for i, s in late.items():
            if s == step:
                engine.add_request(f"req-{i}", prompts[i], params[i])
        for out in engine.step():
            i = int(out.request_id.split("-")[1])
            streamed[i] += out.new_token_ids
            texts[i] += out.new_text
            if out.finished:
                final[i] = out
        step += 1
        assert step < max_steps
    for i, out in final.items():
        assert streamed[i] == out.token_ids and texts[i] == out.text
    return final


def assert_all_blocks_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert engine.kv.ref_counts == [0] * engine.kv.num_blocks
    assert stats.num_running == stats.num_waiting == stats.num_held_blocks == 0


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int,
              logit_bias: dict[int, float] | None = None) -> list[int]:
    """HF transformers `generate`, greedy, EOS disabled (our requests use ignore_eos);
    `logit_bias` goes through HF's own `sequence_bias` (one-token sequences).

    Runs on one thread: steadier than two on a 2-core machine shared with other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    bias = {(t,): b for t, b in logit_bias.items()} if logit_bias else None
    try:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0,
                                    sequence_bias=bias)
    finally:
        torch.set_num_threads(threads)
    return out[0, len(prompt):].tolist()
