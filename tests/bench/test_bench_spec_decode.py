"""`pdmesh bench`'s speculative-decoding section: the counters read from a Prometheus
exposition (pdmesh's own collector and vLLM's spelling), and the rates derived as vLLM's
`bench serve` derives them."""

from __future__ import annotations

import io

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.bench.report import _print_spec_decode, _Table
from services.bench.spec_decode import SpecDecodeSummary, parse_counters, summarise
from services.worker.metrics import EngineStatsCollector
from shared.engine.stats import EngineStats


def exposition(drafts: int, draft_tokens: int, accepted: int, per_pos: tuple[int, ...]) -> str:
    """What a worker's /metrics serves for these engine counters."""
    class Engine:
        def stats(self) -> EngineStats:
            return EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0, 16, 0, spec_num_drafts=drafts,
                               spec_num_draft_tokens=draft_tokens,
                               spec_num_accepted_tokens=accepted,
                               spec_accepted_per_position=per_pos)

    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: Engine(), "m"))  # type: ignore[arg-type,return-value]
    return generate_latest(registry).decode()


def test_the_run_delta_gives_vllms_rates() -> None:
    before = parse_counters(exposition(2, 8, 3, (2, 1, 0, 0)))
    after = parse_counters(exposition(12, 48, 30, (9, 8, 7, 6)))
    s = summarise(before, after)
    assert s == SpecDecodeSummary(
        drafts=10, draft_tokens=40, accepted_tokens=27, acceptance_rate=27 / 40,
        mean_acceptance_length=1 + 27 / 10,
        per_position_acceptance_rate=(7 / 10, 7 / 10, 7 / 10, 6 / 10))
    out = io.StringIO()
    _print_spec_decode(s, _Table(out))
    assert "Acceptance rate (%):" in out.getvalue() and "67.50" in out.getvalue()
    assert "Acceptance length:" in out.getvalue() and "3.70" in out.getvalue()


def test_vllm_prefix_and_labels_are_summed() -> None:
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="x"} 4.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="x"} 6.0',
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="x"} 30.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="x"} 12.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 7.0',
        ""])
    c = parse_counters(text)
    assert c is not None
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (10, 30, 12)
    assert c.accepted_per_position == (7, 5)


@pytest.mark.parametrize("text", ["", "# TYPE pdmesh:requests counter\npdmesh:requests_total 3\n"])
def test_no_counters_no_section(text: str) -> None:
    assert parse_counters(text) is None
    assert summarise(None, parse_counters(exposition(1, 1, 1, (1,)))) is None


def test_no_drafts_in_the_run_gives_no_rates() -> None:
    same = parse_counters(exposition(3, 9, 4, (3, 1, 0)))
    s = summarise(same, same)
    assert s is not None and s.drafts == 0
    assert (s.acceptance_rate, s.mean_acceptance_length) == (None, None)
