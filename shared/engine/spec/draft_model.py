"""The draft-model proposer: a second, smaller model drafts K tokens greedily for a request.

The draft is loaded from its own checkpoint with its own config: its geometry, its RoPE
(theta, scaling, partial rotary...) and its context limit come from the draft's config.json,
never from the target's (vLLM first took the RoPE layout from the target and acceptance fell
from ~2.0 to ~1.0 until vLLM #54373 reverted to the draft's own config). Nothing is
overridden. The draft must share the target's tokenizer (same token -> id map): checked at
start-up, refused otherwise. With model = the target's checkpoint and quantization = "mxfp4"
it is the quantised self-draft: the MXFP4 copy proposes, the bf16 target verifies.

With draft_vocab_size N the draft's LM head is cut to its first N rows (a view: no copy) before
the kernels are swapped in, so the draft scores and drafts token ids < N only.

The draft has its own paged KV cache (the engine's kv_cache_memory_bytes again) and a shadow
Request per target request: its tokens follow the target's, its num_computed_tokens says how
much of them the draft's cache holds. Each proposal first catches the shadow up (the whole
prompt the first time: in P/D the draft is prefilled on the decode worker, so only the target's
KV moves and the compat hash is unchanged), then feeds its own greedy tokens K - 1 times. The
quantised self-draft skips that first prefill: its checkpoint, and so its cache geometry, is
the target's, so a new shadow starts from a copy of the KV blocks the target has computed (the
bf16 target's K/V, as good a context as the draft's own or better; which KV the draft reads
changes its proposals only, never the verified output). That saves a prefill of the whole
prompt by the draft on each request's first speculating step (~100 ms for a 150-token chat
prompt on 2 Zen 4 cores, against ~9 ms per decoded token). Rejected drafts are rolled back at
the next proposal: the shadow keeps the common prefix of its tokens and the target's, and frees
the blocks past it. The drafts of a step's requests are computed together (one draft pass per
position, a row per request).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from shared.config import EngineConfig
from shared.engine.block_manager import KVCacheManager
from shared.engine.request import Request
from shared.engine.runner import KVGeometry, ModelRunner
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledBatch
from shared.model.tokenizer import Tokenizer
from shared.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class DraftModelProposer:
    """Greedy drafts from a draft model over its own KV cache (engine thread only)."""

    def __init__(self, runner: ModelRunner, block_size: int, max_model_len: int,
                 target_cache: torch.Tensor | None = None) -> None:
        self.runner = runner
        # The target's paged cache when a new shadow may start from a copy of its blocks
        # (the self-draft: same checkpoint, hence the same cache layout), else None.
        assert target_cache is None or same_block_layout(target_cache, runner.kv_cache)
        self.target_cache = target_cache
        # No sliding_window: a shadow rolls back past drafts it allocated for, below where a
        # window drop would have been counted (the draft model's attention still windows).
        self.kv = KVCacheManager(runner.num_blocks, block_size, enable_prefix_caching=False)
        self.max_model_len = max_model_len  # the draft's own limit (its config)
        self._shadows: dict[str, Request] = {}

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to k greedy draft tokens continuing request.all_token_ids."""
        return self.propose_batch([(request, k)]).get(request.request_id, [])

    def propose_batch(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Drafts for several requests (request, at most k tokens each), computed together:
        draft pass j runs one row per request still drafting (its catch-up rows at j = 0)."""
        todo = [(self._sync(r), min(k, self.max_model_len - r.num_tokens)) for r, k in wanted]
        drafts: dict[str, list[int]] = {s.request_id: [] for s, k in todo if k >= 1}
        active = [(s, k) for s, k in todo if k >= 1]
        while active:
            rows = [s.num_tokens - s.num_computed_tokens for s, _ in active]  # each >= 1
            fits = [self.kv.allocate_slots(s, n) for (s, _), n in zip(active, rows, strict=True)]
            for (s, _), ok in zip(active, fits, strict=True):
                if not ok:  # the draft's cache is full: no draft for it now
                    self.release(s.request_id)
                    drafts.pop(s.request_id)
            active, rows = ([a for a, ok in zip(active, fits, strict=True) if ok],
                            [n for n, ok in zip(rows, fits, strict=True) if ok])
            if not active:
                break
            shadows = [s for s, _ in active]
            out = self.runner.execute(ScheduledBatch(
                shadows, rows, [s.num_computed_tokens for s in shadows], [True] * len(rows)))
            for s, n, token in zip(shadows, rows, out.sampled_token_ids, strict=True):
                s.num_computed_tokens += n
                if token is not None:  # None: NaN / inf logits in the draft, stop drafting
                    drafts[s.request_id].append(token)
                    s.append_output_token(token)
            active = [(s, k) for (s, k), t in zip(active, out.sampled_token_ids, strict=True)
                      if t is not None and len(drafts[s.request_id]) < k]
        return drafts

    def _sync(self, request: Request) -> Request:
        """The request's shadow, its tokens equal to the request's and its cache trimmed to
        the prefix both still share (a rejected draft's KV is dropped)."""
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, list(request.prompt_token_ids), _GREEDY)
            self._shadows[request.request_id] = shadow
            # All the tokens first: the KV copy marks up to the target's computed ones done.
            for token in request.output_token_ids:
                shadow.append_output_token(token)
            self._copy_target_kv(request, shadow)
        mine, theirs = shadow.all_token_ids, request.all_token_ids
        common = shadow.num_prompt_tokens
        limit = min(len(mine), len(theirs))
        while common < limit and mine[common] == theirs[common]:
            common += 1
        shadow.truncate_output(common - shadow.num_prompt_tokens)
        for token in theirs[common:]:
            shadow.append_output_token(token)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common)
        self.kv.trim(shadow)
        return shadow

    def _copy_target_kv(self, request: Request, shadow: Request) -> None:
        """A new shadow of the self-draft: the target's computed KV copied block by block
        (cache [L, 2, num_blocks, block_size, KVH, D] on both sides). No-op without a target
        cache, or when the target's table lacks blocks (a sliding window dropped them) or
        the draft's cache is short (the shadow then catches up by prefilling, as others do)."""
        n = request.num_computed_tokens
        blocks = self.kv.blocks_needed(n)
        if self.target_cache is None or n == 0 or len(request.block_table) < blocks:
            return
        if not self.kv.allocate_slots(shadow, n):
            return
        src = torch.tensor(request.block_table[:blocks])
        dst = torch.tensor(shadow.block_table[:blocks])
        self.runner.kv_cache.index_copy_(2, dst, self.target_cache.index_select(2, src))
        shadow.num_computed_tokens = n

    def tracks(self, request_id: str) -> bool:
        return request_id in self._shadows

    def release(self, request_id: str) -> None:
        """Free a request's draft state (it finished, or the draft's cache ran out)."""
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)


def build_draft_proposer(config: EngineConfig, tokenizer: Tokenizer,
                         target_cache: torch.Tensor | None = None) -> DraftModelProposer:
    """Load config.speculative_config's draft model (its own config) and check its tokenizer.
    target_cache: the target's paged KV cache; a self-draft (the target's own checkpoint)
    starts each request from a copy of its blocks (module docstring)."""
    from shared.engine.accelerate import accelerate
    from shared.model.loader import load_model
    from shared.model.quant import QuantConfig
    from shared.model.registry import resolve_model

    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    draft_dir = resolve_model(spec.model, config.resolved_cache_dir,
                              hub_cache=config.hf_hub_cache)
    check_same_tokenizer(tokenizer, Tokenizer(draft_dir), spec)
    quant = QuantConfig.parse(spec.quantization)
    if quant is not None and spec.quantize_lm_head:
        quant = dataclasses.replace(quant, quantize_lm_head=True)
    model, draft_config = load_model(draft_dir, config.dtype, quantization=quant)
    vocab = draft_config.vocab_size
    if spec.draft_vocab_size is not None:
        if spec.draft_vocab_size > vocab:
            raise ValueError(f"speculative_config.draft_vocab_size {spec.draft_vocab_size} "
                             f"exceeds the draft model's vocabulary ({vocab})")
        vocab = spec.draft_vocab_size
        cut_lm_head(model, vocab)
    accelerate(model, config)
    geometry = KVGeometry.for_model(config, draft_config, draft_config.num_layers)
    runner = ModelRunner(model, geometry, config, vocab)
    log.info("speculative draft model %s (%s): %d layers, rope %s, %d KV blocks, drafts ids "
             "< %d", spec.model, spec.quantization or config.dtype, draft_config.num_layers,
             draft_config.rope, runner.num_blocks, vocab)
    limit = min(draft_config.max_position_embeddings, runner.num_blocks * config.block_size)
    own = resolve_model(config.model, config.resolved_cache_dir, revision=config.revision,
                        hub_cache=config.hf_hub_cache)
    copy_from = (target_cache if target_cache is not None and own == draft_dir
                 and draft_config.kv_window is None
                 and same_block_layout(target_cache, runner.kv_cache) else None)
    return DraftModelProposer(runner, config.block_size, limit, copy_from)


def same_block_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether blocks of paged cache a ([L, 2, num_blocks, block_size, KVH, D]) copy into b:
    every dim but the number of blocks, and the dtype, agree."""
    return a.shape[:2] == b.shape[:2] and a.shape[3:] == b.shape[3:] and a.dtype == b.dtype


@torch.no_grad()
def cut_lm_head(model: nn.Module, rows: int) -> None:
    """Replace model.lm_head ([vocab, hidden], dense or MXFP4) by one over its first `rows`
    output rows. The new head's tensors are views of the old ones' leading rows (contiguous,
    so the GEMV kernels take them as they are); a head tied to the embedding stays shared."""
    from shared.model.quant import MXFP4Linear

    head = getattr(model, "lm_head", None)
    cut: MXFP4Linear | nn.Linear
    if isinstance(head, MXFP4Linear):
        cut = MXFP4Linear(head.in_features, rows, head.bias is not None, head.path,
                          head.scratch, head.encoder)
        cut.weight_blocks = head.weight_blocks[:rows]
        cut.weight_scales = head.weight_scales[:rows]
    elif type(head) is nn.Linear:
        cut = nn.Linear(head.in_features, rows, bias=head.bias is not None, device="meta")
        cut.weight = nn.Parameter(head.weight[:rows], requires_grad=False)
    else:
        raise ValueError(f"speculative_config.draft_vocab_size: the draft's LM head is a "
                         f"{type(head).__name__}, which cannot be cut")
    if head.bias is not None:
        cut.bias = nn.Parameter(head.bias[:rows], requires_grad=False)
    model.lm_head = cut


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, spec: SpeculativeConfig) -> None:
    """Refuse a draft whose token -> id map differs from the target's."""
    if target.backend.get_vocab(with_added_tokens=True) != draft.backend.get_vocab(
            with_added_tokens=True):
        raise ValueError(f"speculative_config.model {spec.model!r}: its tokenizer differs from "
                         "the target model's (draft and target must share the tokenizer)")
