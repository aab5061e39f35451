"""A PP prefill worker's KV service declares the stages its engine really runs.

The worker passes its pipeline size to the KV service; the service's NodeInfo declares the
layer ranges of the partition it was given (the even split by default), which must be exactly
the engine's own stage split (PipelineConfig.layer_ranges), uneven partitions included.
"""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.kv_transfer.config import KVTransferConfig
from services.kv_transfer.service import stage_ranges_of
from services.worker.config import WorkerConfig, add_arguments
from shared.pipeline.config import PipelineConfig
from shared.protocol.messages import NodeInfo
from shared.protocol.pd import Role


@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_declared_stage_ranges_are_the_engines_split(layers_pp) -> None:
    layers, pp = layers_pp
    node = NodeInfo("e", "prefill", "pull", 16, 8, 0, layers, pp, "127.0.0.1", 1)
    assert node.stage_ranges == PipelineConfig(pp_size=pp).layer_ranges(layers)


def prefill_kv() -> KVTransferConfig:
    return KVTransferConfig(role="prefill", port=0)


def test_the_kv_service_gets_the_pipeline_size() -> None:
    config = WorkerConfig(role=Role.PREFILL, kv=prefill_kv(),
                          pipeline=PipelineConfig(pp_size=2))
    assert config.kv is not None and config.kv.pp_size == 2
    single = WorkerConfig(role=Role.PREFILL, kv=prefill_kv())
    assert single.kv is not None and single.kv.pp_size == 1


@pytest.mark.parametrize("partition", [(3, 1), (1, 3), (2, 1, 1), (1, 1, 2)])
def test_an_uneven_partition_is_declared_as_the_engine_runs_it(partition) -> None:
    pipeline = PipelineConfig(pp_size=len(partition), layer_partition=partition)
    config = WorkerConfig(role=Role.PREFILL, kv=prefill_kv(), pipeline=pipeline)
    assert config.kv is not None and config.kv.layer_partition == partition
    node = NodeInfo("e", "prefill", "pull", 16, 8, 0, 4, config.kv.pp_size, "127.0.0.1", 1,
                    layer_ranges=stage_ranges_of(0, config.kv.layer_partition))
    assert node.stage_ranges == pipeline.layer_ranges(4)


def test_serve_flags_build_a_pp_prefill() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--role", "prefill", "--pp-size", "2", "--transfer-mode", "push",
                              "--kv-port", "0"])
    config = WorkerConfig.from_args(args, {})
    assert config.pipeline.pp_size == 2 and config.kv is not None
    assert (config.kv.pp_size, config.kv.mode, config.kv.role) == (2, "push", "prefill")


def test_a_pipelined_worker_refuses_speculative_decoding() -> None:
    """Pipeline stages decode one token per step: --speculative-config is refused up front."""
    from shared.config import EngineConfig

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="--speculative-config"):
        WorkerConfig(engine=EngineConfig(speculative_config=spec),  # type: ignore[arg-type]
                     pipeline=PipelineConfig(pp_size=2))
    WorkerConfig(engine=EngineConfig(speculative_config=spec))  # type: ignore[arg-type]
