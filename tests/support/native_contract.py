"""The comparison behind "the native path equals the plain path" (stated, with its thresholds,
in test_native_decode.py): record what an engine sampled from, recompute it with the plain
model teacher-forced over the same tokens, and list every position that breaks the contract.

    recorder = LogitRecorder(engine)            # before the requests run
    ...run greedy requests...
    ref = reference_logits(plain_model, prompt + recorder.tokens[rid])[len(prompt) - 1:-1]
    stats = compare_positions(rid, recorder.tokens[rid], recorder.stacked(rid), ref)
    assert not violations(stats, tolerance)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from shared.engine.engine import LLMEngine
from shared.model.attention import AttentionMetadata
from shared.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Tolerance:
    """logit_atol bounds max |native - reference| over the vocabulary at each position;
    tie_gap is how far below the reference's best logit the native token may lie."""

    logit_atol: float
    tie_gap: float


@dataclass(frozen=True)
class PositionStats:
    """One generated position: the native token against the teacher-forced reference."""

    request: str
    step: int  # 0: the token sampled after the prompt
    token: int  # what the native engine produced
    ref_token: int  # the reference's argmax
    max_abs_diff: float  # max over the vocabulary of |native - reference| logits
    ref_gap: float  # reference[ref_token] - reference[token]: 0 when they agree
    ref_top2_gap: float  # the reference's top-1 minus top-2 logit


class LogitRecorder:
    """Wraps an engine's runner to keep, per request id, every sampled token and the fp32
    logits [V] it was sampled from (runner rows map back to requests in batch order). One per
    engine: a second would record through the first. Where the screened greedy head picked a
    token without logits, the full head computes them here, and its argmax must be that token."""

    def __init__(self, engine: LLMEngine) -> None:
        if getattr(engine.runner, "recorded", False):
            raise ValueError("this engine already has a LogitRecorder")
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        runner, model = engine.runner, engine.runner.model
        execute, compute_logits = runner.execute, model.compute_logits
        last: list[torch.Tensor] = []

        def recording_logits(hidden: torch.Tensor) -> torch.Tensor:
            out = compute_logits(hidden)
            last.append(out.clone())
            return out

        def recording_execute(batch):  # noqa: ANN001, ANN202 - ModelRunner.execute's signature
            last.clear()
            out = execute(batch)
            rows = [i for i, t in enumerate(out.sampled_token_ids) if t is not None]
            if rows:
                (logits,) = last  # one compute_logits call per step, one row per sampled request
                for j, i in enumerate(rows):
                    rid = batch.requests[i].request_id
                    self.tokens[rid].append(out.sampled_token_ids[i])
                    self.logits[rid].append(logits[j])
            return out

        model.compute_logits = recording_logits  # instance attributes shadow the methods
        runner.execute = recording_execute
        runner.recorded = True
        screen = runner.greedy_head
        if screen is not None:  # greedy rows skip the logits: record them anyway, and check
            pick = screen.forward

            def checked_pick(hidden: torch.Tensor) -> list[int] | None:
                tokens = pick(hidden)
                if tokens is not None:
                    logits = recording_logits(hidden)
                    assert tokens == logits.argmax(-1).tolist(), "screen != the head's argmax"
                return tokens

            screen.forward = checked_pick

    def stacked(self, request_id: str) -> torch.Tensor:
        """logits [N, V] of request_id's N sampled tokens."""
        return torch.stack(self.logits[request_id])


@torch.inference_mode()
def reference_logits(model: LlamaForCausalLM, ids: list[int], block_size: int = 16
                     ) -> torch.Tensor:
    """fp32 logits [T, V] at every position of ids: one prefill of the whole sequence through
    the plain model (torch layers) over a fresh paged cache."""
    cfg = model.config
    blocks = -(-len(ids) // block_size)
    kv = torch.zeros(model.num_local_layers, 2, blocks, block_size, cfg.num_kv_heads,
                     cfg.head_dim, dtype=model.dtype)
    meta = AttentionMetadata.build([0], [len(ids)], [list(range(blocks))], block_size)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta, kv)
    return model.compute_logits(hidden)


def compare_positions(request: str, tokens: list[int], native: torch.Tensor,
                      reference: torch.Tensor) -> list[PositionStats]:
    """Per generated position i: tokens[i] sampled from native[i], against reference[i] [V]
    (the reference's logits after the prompt and tokens[:i])."""
    if not len(tokens) == native.shape[0] == reference.shape[0]:
        raise ValueError(f"{len(tokens)} tokens, {native.shape[0]} native and "
                         f"{reference.shape[0]} reference rows")
    stats = []
    for i, tok in enumerate(tokens):
        ref = reference[i]
        top2 = ref.topk(2).values
        ref_token = int(ref.argmax())
        stats.append(PositionStats(
            request, i, tok, ref_token,
            max_abs_diff=float((native[i] - ref).abs().max()),
            ref_gap=float(ref[ref_token] - ref[tok]),
            ref_top2_gap=float(top2[0] - top2[1])))
    return stats


def violations(stats: list[PositionStats], tol: Tolerance) -> list[str]:
    """What breaks the contract: logits beyond logit_atol anywhere, or a native token other
    than the reference's argmax that is not within tie_gap of it (a near-tie)."""
    bad = []
    for s in stats:
        where = f"{s.request} step {s.step}"
        if s.max_abs_diff > tol.logit_atol:
            bad.append(f"{where}: logits differ by {s.max_abs_diff:.4f} > {tol.logit_atol}")
        if s.token != s.ref_token and s.ref_gap >= tol.tie_gap:
            bad.append(f"{where}: token {s.token} instead of {s.ref_token}, "
                       f"{s.ref_gap:.4f} below the reference's best (a near-tie is < "
                       f"{tol.tie_gap})")
    return bad
