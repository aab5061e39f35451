"""Pipeline-parallel configuration: how many stages, which layers each runs, how they meet.

Built once (from `--pp-size` / `--pp-layer-partition`, or from `PipelineLLM` kwargs) and passed
down to stage 0 and, pickled, to every stage process. Nothing here touches torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.pipeline.netns import netns_path
from shared.protocol.layout import even_layer_ranges


def parse_partition(text: str | None) -> tuple[int, ...] | None:
    """'10,10,10' -> (10, 10, 10); None or '' -> None (even split). Raises ValueError."""
    if text is None or not text.strip():
        return None
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--pp-layer-partition must be comma-separated integers, got {text!r}"
                         ) from None
    return sizes


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline: `pp_size` stages joined by torch.distributed (gloo), on loopback by default.

    layer_partition: decoder layers per stage (sums to the model's layer count, each >= 1);
        None splits evenly, giving the remainder to the first stages (the last one also
        runs the lm_head). master_addr is where rank 0 listens (the TCP store and its
        gloo pairs; loopback by default); master_port 0 picks a free port.
    stage_addrs: the address each of ranks 1..N-1 binds its gloo pairs to, in rank order;
        empty means master_addr for all (stages on the same host as rank 0).
    stage_netns: a network namespace (an `ip netns` name, /run/netns/NAME) that ranks
        1..N-1 enter before opening any socket, so stages can sit on the far side of a
        link (the two-host benchmark); needs CAP_SYS_ADMIN. None: rank 0's namespace.
    connect_timeout_s bounds start-up: the rendezvous and every stage loading its layers.
    step_timeout_s bounds any single wait inside a step (a stage's reply, a send draining);
        past it the stage counts as hung and the pipeline fails.
    blocking_handoff is the benchmark baseline: stage 0 waits for a step's sampled tokens
        right after sending it (and the last stage waits for its token send), so
        microbatches never overlap.
    """

    pp_size: int = 1
    layer_partition: tuple[int, ...] | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    stage_addrs: tuple[str, ...] = ()
    stage_netns: str | None = None
    connect_timeout_s: float = 120.0
    step_timeout_s: float = 60.0
    blocking_handoff: bool = False

    def __post_init__(self) -> None:
        if self.pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {self.pp_size}")
        if self.layer_partition is not None:
            object.__setattr__(self, "layer_partition", tuple(self.layer_partition))
            if len(self.layer_partition) != self.pp_size:
                raise ValueError(f"layer partition {list(self.layer_partition)} has "
                                 f"{len(self.layer_partition)} stages, pp_size is {self.pp_size}")
            if any(n < 1 for n in self.layer_partition):
                raise ValueError(f"every stage needs >= 1 layer, got {list(self.layer_partition)}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if self.connect_timeout_s <= 0 or self.step_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        object.__setattr__(self, "stage_addrs", tuple(self.stage_addrs))
        if self.stage_addrs and len(self.stage_addrs) != self.pp_size - 1:
            raise ValueError(f"stage addresses {list(self.stage_addrs)} name "
                             f"{len(self.stage_addrs)} stages, pp_size {self.pp_size} has "
                             f"{self.pp_size - 1} besides rank 0")
        if self.stage_netns is not None:
            netns_path(self.stage_netns)  # raises ValueError for a path-like name

    def bind_addr(self, rank: int) -> str:
        """The address rank `rank` binds its gloo pairs to (rank 0: master_addr)."""
        if not 0 <= rank < self.pp_size:
            raise ValueError(f"rank {rank} outside a pipeline of {self.pp_size} stages")
        if rank == 0 or not self.stage_addrs:
            return self.master_addr
        return self.stage_addrs[rank - 1]

    @property
    def enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def is_even(self) -> bool:
        """True when the stages get the even split (no partition, or one equal to it)."""
        if self.layer_partition is None:
            return True
        total = sum(self.layer_partition)
        return self.layer_partition == tuple(
            b - a for a, b in even_layer_ranges(0, total, self.pp_size))

    def layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Layers per stage for a model with num_layers; raises ValueError if impossible."""
        if self.pp_size > num_layers:
            raise ValueError(f"pp_size {self.pp_size} exceeds the model's {num_layers} layers")
        if self.layer_partition is None:
            return tuple(b - a for a, b in even_layer_ranges(0, num_layers, self.pp_size))
        if sum(self.layer_partition) != num_layers:
            raise ValueError(f"layer partition {list(self.layer_partition)} sums to "
                             f"{sum(self.layer_partition)}, the model has {num_layers} layers")
        return self.layer_partition

    def layer_ranges(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """[(start, end)] per stage: stage i runs global layers start..end-1."""
        ranges, start = [], 0
        for count in self.layer_counts(num_layers):
            ranges.append((start, start + count))
            start += count
        return tuple(ranges)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `pdmesh serve` flags for pipeline parallelism (read back with `from_args`)."""
    group = parser.add_argument_group("pipeline parallelism")
    group.add_argument("--pp-size", type=int, default=1,
                       help="split the model's layers across this many stage processes")
    group.add_argument("--pp-layer-partition", default=None, metavar="N,N,...",
                       help="layers per stage (default: even); e.g. 19,11 for SmolLM2 at PP=2 "
                            "balances the last stage's lm_head")
    group.add_argument("--pp-master-port", type=int, default=0,
                       help="TCP store port for the stages' rendezvous (0: any free port)")
    group.add_argument("--pp-master-addr", default="127.0.0.1",
                       help="address rank 0 listens on for the rendezvous and gloo")
    group.add_argument("--pp-stage-addrs", default=None, metavar="ADDR,...",
                       help="address each stage after rank 0 binds gloo to (default: "
                            "--pp-master-addr)")
    group.add_argument("--pp-stage-netns", default=None, metavar="NAME",
                       help="network namespace (`ip netns` name) the stages after rank 0 "
                            "enter first; needs CAP_SYS_ADMIN")


def from_args(args: argparse.Namespace) -> PipelineConfig:
    return PipelineConfig(pp_size=args.pp_size,
                          layer_partition=parse_partition(args.pp_layer_partition),
                          master_port=args.pp_master_port, master_addr=args.pp_master_addr,
                          stage_addrs=tuple(a.strip() for a in args.pp_stage_addrs.split(","))
                          if args.pp_stage_addrs else (),
                          stage_netns=args.pp_stage_netns)
