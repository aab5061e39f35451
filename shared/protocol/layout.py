"""How KV blocks are laid out, in terms both sides of a transfer must agree on.

`KV_LAYOUT` names the cache tensor's dimension order; it is a compat-hash factor, so two
workers with different layouts never pair. `even_layer_ranges` is the default split of a span
of decoder layers into pipeline stages: the pipeline uses it to place its stages, and a KV
peer that declares no per-stage ranges is assumed to use it.
"""

from __future__ import annotations

# kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], index 0 of dim 1
# is K and 1 is V (shared/model/attention.py reads and writes it).
KV_LAYOUT = "L2NBHD"

LayerRange = tuple[int, int]  # global decoder layers [start, end)


def even_layer_ranges(start: int, end: int, parts: int) -> tuple[LayerRange, ...]:
    """Layers [start, end) split into `parts` contiguous ranges, the remainder going to the
    first ones (the default layout of every stage split, also what a KV peer assumes)."""
    if parts < 1 or end - start < parts:
        raise ValueError(f"cannot split layers [{start}, {end}) into {parts} non-empty stages")
    base, extra = divmod(end - start, parts)
    ranges, lo = [], start
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return tuple(ranges)
