"""Turning a request into a `Route`: a servable group, a decision, and the worker(s) to use.

The decision is conditional disaggregation: prompts with fewer tokens than the threshold
(`disagg_threshold.py`: `--disagg-min-tokens N`, or learned with `auto`, which is told the
decode side's load at each decision) skip the prefill leg and go to a decode (or mixed) worker; a group made only of mixed workers
serves everything locally. A request no P/D leg can serve (n>1, several prompts; see
`legs.needs_single_worker`) goes whole to one worker: a mixed one if any group has one healthy,
else a decode worker, which computes the prompt itself. Workers come from one group only, which
is what makes a pairing compatible. Workers that just failed this request are avoided while
others remain.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

from services.router.config import Policy, RouterConfig
from services.router.disagg_threshold import DisaggThreshold
from services.router.errors import NoServableGroupError
from services.router.policies import (
    Candidate,
    PolicyState,
    PrefixIndex,
    chained_block_hashes,
    pick,
)
from services.router.registry import Group, WorkerRegistry
from services.router.workers import Worker


class Decision(StrEnum):
    """How one request is served; the label of pdmesh:disagg_decision_total."""

    PREFILL_DECODE = "prefill_decode"
    DECODE_ONLY = "decode_only"  # short prompt: a decode worker computes it locally
    MIXED = "mixed"  # a mixed worker serves it alone
    SINGLE_WORKER = "single_worker"  # no P/D leg serves it (n>1...): one worker, whole


@dataclass(frozen=True)
class Route:
    """Where one attempt goes. `target` produces the client's response (decode or mixed)."""

    decision: Decision
    group: Group
    target: Worker
    prefill: Worker | None = None

    @property
    def push(self) -> bool:
        return self.group.transfer_mode == "push"

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Count the attempt on its workers (`Worker.attempts`) from planning to its end, so a
        draining worker leaves the registry only once no attempt that chose it is left (a pull
        decode is chosen before its prefill leg runs)."""
        workers = [w for w in (self.target, self.prefill) if w is not None]
        for worker in workers:
            worker.attempts += 1
        try:
            yield
        finally:
            for worker in workers:
                worker.attempts -= 1


def _group_load(workers: Sequence[Worker]) -> float:
    return sum(Candidate.of(w).load for w in workers) / max(len(workers), 1)


class Pairing:
    """Plans routes over the registry with the configured policies and prefix index."""

    def __init__(self, registry: WorkerRegistry, config: RouterConfig,
                 state: PolicyState | None = None) -> None:
        self._registry = registry
        self._cfg = config
        self._prefill_state = state or PolicyState()
        self._decode_state = PolicyState(rng=self._prefill_state.rng)
        self.prefix = PrefixIndex()
        self.threshold = DisaggThreshold(config.disagg_min_tokens, config.disagg_learning)

    def needs_tokens(self, whole: bool = False) -> bool:
        """Whether planning uses prompt token ids (else the router never tokenises); a whole
        request only picks a decode/mixed worker, by the decode policy alone."""
        if whole:
            return self._cfg.decode_policy is Policy.PREFIX_AWARE
        return (self.threshold.auto or self.threshold.tokens > 0
                or Policy.PREFIX_AWARE in (self._cfg.prefill_policy, self._cfg.decode_policy))

    def plan(self, prompt_ids: Sequence[int] | None, avoid: set[str],
             whole: bool = False) -> Route:
        """The route of one attempt; `whole`: the request must run on one worker."""
        groups = self._registry.servable_groups()
        if not groups:
            raise NoServableGroupError(self._registry.unservable_reason(),
                                       transient=self._transient())
        if whole:
            return self._plan_whole(groups, prompt_ids, avoid)
        pd = [g for g in groups if g.pd_servable]
        if pd:
            self.threshold.observe_batch(min(_group_load(g.usable_decode) for g in pd))
        short = prompt_ids is not None and len(prompt_ids) < self.threshold.tokens
        if pd and not short:
            group = min(pd, key=lambda g: _group_load(g.usable_prefill + g.usable_decode))
            prefill = self._choose(self._cfg.prefill_policy, group.usable_prefill, avoid,
                                   prompt_ids, group, self._prefill_state)
            decode = self._choose(self._cfg.decode_policy, group.usable_decode, avoid,
                                  prompt_ids, group, self._decode_state)
            return Route(Decision.PREFILL_DECODE, group, decode, prefill)
        local = [g for g in groups if g.usable_decode or g.usable_mixed]
        group = min(local, key=lambda g: _group_load(g.usable_decode + g.usable_mixed))
        target = self._choose(self._cfg.decode_policy, group.usable_decode + group.usable_mixed,
                              avoid, prompt_ids, group, self._decode_state)
        return Route(Decision.MIXED if target in group.usable_mixed else Decision.DECODE_ONLY,
                     group, target)

    def _plan_whole(self, groups: Sequence[Group], prompt_ids: Sequence[int] | None,
                    avoid: set[str]) -> Route:
        """Mixed workers first (whole requests are their job, and it keeps the P/D pairs
        free), then decode workers; workers that just failed this request are passed over
        while any other is left (a servable group has a usable mixed or decode worker)."""
        tiers = [[(g, g.usable_mixed) for g in groups if g.usable_mixed],
                 [(g, g.usable_decode) for g in groups if g.usable_decode]]
        fresh = [[(g, ws) for g, ws in tier if any(w.id not in avoid for w in ws)]
                 for tier in tiers]
        tier = next((t for t in fresh if t), None) or next(t for t in tiers if t)
        group, workers = min(tier, key=lambda gw: _group_load(gw[1]))
        target = self._choose(self._cfg.decode_policy, workers, avoid, prompt_ids, group,
                              self._decode_state)
        return Route(Decision.SINGLE_WORKER, group, target)

    def _choose(self, policy: Policy, workers: Sequence[Worker], avoid: set[str],
                prompt_ids: Sequence[int] | None, group: Group, state: PolicyState) -> Worker:
        pool = [w for w in workers if w.id not in avoid] or list(workers)
        # A half-open worker already probing gets more only when nothing else is left.
        pool = [w for w in pool if not w.breaker.probing()] or pool
        hashes = None
        if policy is Policy.PREFIX_AWARE and prompt_ids is not None:
            hashes = chained_block_hashes(prompt_ids, self._block_size(group))
        matches = self.prefix.matches((w.id for w in pool), hashes) if hashes else None
        chosen = pick(policy, [Candidate.of(w) for w in pool], state, matches,
                      overload_abs=self._cfg.overload_abs, overload_rel=self._cfg.overload_rel)
        worker = next(w for w in pool if w.id == chosen.id)
        if hashes:
            self.prefix.record(worker.id, hashes)
        return worker

    def _block_size(self, group: Group) -> int:
        for w in group.usable_prefill + group.usable_decode + group.usable_mixed:
            if w.metadata is not None and w.metadata.block_size:
                return w.metadata.block_size
        return self._cfg.prefix_block_size

    def _transient(self) -> bool:
        """Would waiting help? Yes if some group could serve once its workers recover, or some
        worker has not answered yet; no if a needed role is missing from every group."""
        if any(w.metadata is None for w in self._registry.all()):
            return True
        return any((g.prefill and g.decode) or g.mixed for g in self._registry.groups())
