"""KV-cache block accounting: reference counts, LRU free queue, prefix caching, held blocks.

Invariants:
- A block is in the free queue iff its reference count is 0 (held blocks keep a count).
- A block whose KV has been computed for a FULL block of tokens may carry a prefix-cache key
  `(parent_hash, tokens)`; `hash(key)` is that block's chained hash. The key is kept while the
  block sits in the free queue, so a later request can revive it; it is dropped only when the
  block is popped for reuse (evicted). Keys are registered only once the KV is computed, so a
  hit never points at KV that was never written.
- The free queue pops from its head (least recently freed). Blocks of a request are freed
  tail-first, so a request's later blocks are evicted before its earlier ones, which keeps
  the shared prefixes alive longest.
- Sliding window (`sliding_window` W: every layer of the model slides, W the largest window):
  the query at position p reads keys > p - W only, so once a request has computed c tokens no
  future query reads positions < c - W + 1. Blocks wholly before that are dropped from the
  request when it next allocates: released like any freed block, and their table entries
  become DROPPED_BLOCK (the runner reads those as block 0; attention never reads them). So a
  long prompt holds about (W + chunk) / block_size blocks, not its length. A dropped block
  keeps its prefix-cache key: its KV is final and still valid, so a later request may revive
  it as part of a cached prefix (a hit is always a chain from block 0) until it is evicted.
  Requests that hold their KV for a peer (hold_kv: a P/D prefill, and push streaming) never
  drop blocks: the transfer sends the whole block table and the decode side drops what is
  outside the window at its first step. With a full-attention layer, nothing is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.engine.request import Request, RequestStatus

BlockKey = tuple[int, tuple[int, ...]]  # (parent block hash, token ids of this block)
DROPPED_BLOCK = -1  # block-table entry of a block dropped from a sliding window
_ROOT_HASH = 0x5EED_B10C
# Only a normally finished request keeps its KV for a peer; an aborted or failed one frees it.
_HOLDABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix-cache hit for a new request: the blocks and the number of tokens they cover."""

    block_ids: list[int]
    num_tokens: int


class KVCacheManager:
    """Owns every block id in [0, num_blocks); the scheduler asks it for slots per step.

    Counters (in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits): every admission
    of a request without KV (`allocate_slots` given a lookup result) adds its num_tokens to
    `prefix_cache_queries` and the hit length to `prefix_cache_hits`. `sliding_window` is
    ModelConfig.kv_window (None: keep every block; see the module docstring).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._num_registered: dict[str, int] = {}  # request id -> its blocks with keys
        self._held: dict[str, list[int]] = {}
        self.num_held_blocks = 0  # maintained, so other threads can read it safely
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- stats -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks


    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def _ensure_hashes(self, request: Request, num_full_blocks: int) -> None:
        """Extend request.block_hashes to cover its first num_full_blocks full blocks."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else _ROOT_HASH
            hashes.append(hash((parent, tuple(tokens[i * bs:(i + 1) * bs]))))

    def _key(self, request: Request, i: int) -> BlockKey:
        bs = self.block_size
        parent = request.block_hashes[i - 1] if i else _ROOT_HASH
        return parent, tuple(request.all_token_ids[i * bs:(i + 1) * bs])

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of a request that has no KV yet.

        Only full blocks count, and never the last token: at least one token is always
        computed so the step yields logits. Token ids are compared on a hit (the dict key
        holds them), so a hash collision can never alias two prefixes.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return ComputedBlocks([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_hashes(request, max_blocks)
        hit: list[int] = []
        for i in range(max_blocks):
            block = self._cached.get(self._key(request, i))
            if block is None:
                break
            hit.append(block)
        return ComputedBlocks(hit, len(hit) * self.block_size)

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the keys of the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        done = self._num_registered.get(request.request_id, 0)
        full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        if full <= done:
            return
        self._ensure_hashes(request, full)
        for i in range(done, full):
            key, block = self._key(request, i), request.block_table[i]
            if block == DROPPED_BLOCK:
                continue
            if key not in self._cached and self._block_key[block] is None:
                self._cached[key] = block
                self._block_key[block] = key
        self._num_registered[request.request_id] = full

    def reset_prefix_cache(self) -> None:
        """Forget every key (used after warm-up); counters restart too."""
        self._cached.clear()
        self._block_key = [None] * self.num_blocks
        self._num_registered.clear()
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    # ---- allocation ----------------------------------------------------------------------
    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._block_key[block]
        if key is not None:  # evict: the block's old content is about to be overwritten
            self._block_key[block] = None
            del self._cached[key]
        self.ref_counts[block] = 1
        return block

    def _touch(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> bool:
        """Make room for num_new_tokens after request.num_computed_tokens (+ a prefix hit).

        All or nothing: returns False and changes nothing when blocks are short (except that
        blocks before a sliding window are dropped either way: no query reads them again).
        """
        self._drop_outside_window(request)
        hit = computed.block_ids if computed else []
        total = request.num_computed_tokens + (computed.num_tokens if computed else 0)
        need = self.blocks_needed(total + num_new_tokens) - len(request.block_table) - len(hit)
        revived = sum(1 for b in hit if self.ref_counts[b] == 0)
        if max(need, 0) + revived > len(self._free):
            return False
        for block in hit:
            self._touch(block)
        request.block_table.extend(hit)
        if computed is not None and self.enable_prefix_caching:  # counted once, on admission
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += computed.num_tokens
        request.block_table.extend(self._pop_free() for _ in range(max(need, 0)))
        return True

    def _drop_outside_window(self, request: Request) -> None:
        """Release the request's blocks that no future query of any layer reads.

        Invariant: num_computed_tokens never falls below its value here while the request
        keeps its table (speculation rolls back only drafts scheduled after it; preemption
        frees the whole table), so a dropped block is never needed again."""
        if self.sliding_window is None or request.hold_kv:
            return
        first_read = request.num_computed_tokens - self.sliding_window + 1
        table = request.block_table
        dead = min(max(first_read, 0) // self.block_size, len(table))  # blocks [0, dead)
        live = dead  # dropped entries are a prefix: walk back over the newly dead ones only
        while live > 0 and table[live - 1] != DROPPED_BLOCK:
            live -= 1
        if live < dead:
            dropped = table[live:dead]
            table[live:dead] = [DROPPED_BLOCK] * (dead - live)
            self._release(dropped)

    def trim(self, request: Request) -> None:
        """Free the blocks past request.num_computed_tokens (a rejected speculative draft's).

        Those blocks never carry a prefix-cache key: keys are registered only up to
        num_computed_tokens, which the caller has already rolled back.
        """
        keep = self.blocks_needed(request.num_computed_tokens)
        if len(request.block_table) > keep:
            extra, request.block_table = request.block_table[keep:], request.block_table[:keep]
            self._release(extra)

    def _release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, tail-first (see module docstring); dropped
        entries (DROPPED_BLOCK) were released already."""
        for block in reversed(block_ids):
            if block == DROPPED_BLOCK:
                continue
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def free(self, request: Request) -> None:
        """Release a request's blocks, or move them to the held table if it asked to hold."""
        self._num_registered.pop(request.request_id, None)
        blocks, request.block_table = request.block_table, []
        if request.hold_kv and request.status in _HOLDABLE and blocks:
            self._held[request.request_id] = blocks
            self.num_held_blocks += len(blocks)
        else:
            self._release(blocks)

    # ---- P/D hooks -----------------------------------------------------------------------
    def held_block_ids(self, request_id: str) -> list[int] | None:
        blocks = self._held.get(request_id)
        return list(blocks) if blocks is not None else None

    def release_held(self, request_id: str) -> bool:
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            return False
        self.num_held_blocks -= len(blocks)
        self._release(blocks)
        return True

    def allocate_blocks(self, num_tokens: int) -> list[int] | None:
        """Blocks (ref count 1, owned by the caller) to receive num_tokens of remote KV."""
        n = self.blocks_needed(num_tokens)
        if num_tokens < 1 or n > len(self._free):
            return None
        return [self._pop_free() for _ in range(n)]

    def free_blocks(self, block_ids: list[int]) -> None:
        for block in block_ids:
            if not 0 <= block < self.num_blocks or self.ref_counts[block] < 1:
                raise ValueError(f"block {block} is not allocated")
        self._release(list(block_ids))

    def adopt_blocks(self, request: Request, block_ids: list[int], num_computed_tokens: int) -> None:
        """Give pre-allocated blocks holding num_computed_tokens of KV to a fresh request."""
        if request.block_table or request.num_computed_tokens:
            raise ValueError("request already has KV")
        if len(block_ids) != self.blocks_needed(num_computed_tokens):
            raise ValueError(f"{len(block_ids)} blocks cannot hold exactly {num_computed_tokens} tokens")
        for block in block_ids:
            if not 0 <= block < self.num_blocks or self.ref_counts[block] < 1:
                raise ValueError(f"block {block} is not allocated")
        request.block_table = list(block_ids)
        request.num_computed_tokens = num_computed_tokens
        self.cache_computed_blocks(request)
