"""PipelineConfig (partition validation and parsing) and the wire formats, without processes."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.engine.outputs import TokenLogprob
from shared.engine.sampling_params import SamplingParams
from shared.pipeline.config import PipelineConfig, add_arguments, from_args, parse_partition
from shared.pipeline.wire import MirrorUpdate, RequestRecord, StepHeader, TokenSpec


@pytest.mark.parametrize(("layers", "pp", "counts"), [
    (30, 2, (15, 15)), (30, 4, (8, 8, 7, 7)), (4, 3, (2, 1, 1)), (4, 4, (1, 1, 1, 1)),
])
def test_even_split_gives_the_remainder_to_the_first_stages(layers, pp, counts):
    config = PipelineConfig(pp_size=pp)
    assert config.layer_counts(layers) == counts
    ranges = config.layer_ranges(layers)
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_explicit_partition_is_used_as_given():
    config = PipelineConfig(pp_size=3, layer_partition=(10, 10, 10))
    assert config.layer_ranges(30) == ((0, 10), (10, 20), (20, 30))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pp_size": 0}, "pp_size"),
    ({"pp_size": 2, "layer_partition": (10, 10, 10)}, "3 stages"),
    ({"pp_size": 2, "layer_partition": (30, 0)}, ">= 1 layer"),
    ({"pp_size": 2, "master_port": 70000}, "master_port"),
    ({"pp_size": 2, "step_timeout_s": 0}, "timeouts"),
])
def test_bad_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**kwargs)


def test_partition_must_match_the_model():
    with pytest.raises(ValueError, match="sums to 20"):
        PipelineConfig(pp_size=2, layer_partition=(10, 10)).layer_counts(30)
    with pytest.raises(ValueError, match="exceeds"):
        PipelineConfig(pp_size=5).layer_counts(4)


def test_parse_partition():
    assert parse_partition("10,10,10") == (10, 10, 10)
    assert parse_partition(" 19, 11") == (19, 11)
    assert parse_partition(None) is None and parse_partition("") is None
    with pytest.raises(ValueError, match="comma-separated"):
        parse_partition("10;10")


def test_cli_flags_build_the_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_args(parser.parse_args([])) == PipelineConfig()
    config = from_args(parser.parse_args(["--pp-size", "3", "--pp-layer-partition", "10,10,10"]))
    assert config == PipelineConfig(pp_size=3, layer_partition=(10, 10, 10))
    with pytest.raises(ValueError, match="2 stages"):
        from_args(parser.parse_args(["--pp-size", "3", "--pp-layer-partition", "15,15"]))


@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 64), st.booleans(),
                          st.lists(st.integers(0, 10**5), max_size=8)), min_size=1, max_size=9),
       st.integers(0, 2**40), st.integers(0, 7))
def test_step_header_round_trips(rows, step_id, lane):
    header = StepHeader(step_id, lane, [r[0] + 1 for r in rows], [r[0] for r in rows],
                        [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows])
    assert StepHeader.decode(header.encode()) == header
    assert header.num_samples == sum(r[2] for r in rows)


def test_token_message_without_logprobs_is_just_the_ids():
    spec = TokenSpec(3, (None, None, None))
    data = spec.pack([5, 7, 9], None)
    assert data.shape == spec.empty().shape and data.dtype == spec.empty().dtype
    assert spec.unpack(data) == ([5, 7, 9], [None, None, None])


def test_token_message_round_trips_logprobs_exactly():
    lps = [TokenLogprob(11, -0.25, {11: -0.25, 3: -1.5, 8: -2.0}), None,
           TokenLogprob(4, -3.125, {})]
    spec = TokenSpec(3, (3, None, 0))
    data = spec.pack([11, 12, 4], lps)
    assert data.shape == (3, 2 + 2 * 3)
    assert spec.unpack(data) == ([11, 12, 4], lps)


def test_mirror_update_is_empty_bytes_when_there_is_nothing_to_say():
    assert MirrorUpdate().encode() == b""
    record = RequestRecord(3, "r", [1, 2], [5], SamplingParams(seed=1), frozenset({2}))
    update = MirrorUpdate([record], [1, 2])
    assert MirrorUpdate.decode(update.encode()) == update


def test_the_pipeline_engine_refuses_speculative_decoding():
    """Refused before any stage process starts, naming the option."""
    from shared.config import EngineConfig
    from shared.pipeline.engine import PipelineEngine

    config = EngineConfig(speculative_config={"method": "ngram"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="speculative_config"):
        PipelineEngine(config, PipelineConfig(pp_size=2))
