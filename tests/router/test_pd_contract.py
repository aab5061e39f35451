"""The P/D contract (shared.protocol.pd): each leg's params survive to_wire/from_wire, a newer
version or an unknown field is refused, and what the router builds is what the worker parses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.router.legs import pull_prefill_params, push_params
from services.worker.kv_params import parse_kv_transfer_params
from shared.protocol.codec import ProtocolError
from shared.protocol.messages import TokenLogprobWire
from shared.protocol.pd import (
    PD_VERSION,
    ApiKind,
    KVTransferParams,
    PrefillLegParams,
    PushDecodeParams,
    PushOverlap,
    PushPrefillResult,
    TransferMode,
)

CASES = [
    PrefillLegParams(),
    PrefillLegParams(TransferMode.PUSH, "t-1", decode_engine_id="d"),
    PushDecodeParams("t-1", "10.0.0.2", 7001, "p"),
    KVTransferParams("pull", "p", "10.0.0.2", 7001, "r-1", "l-1", [3, 9], 20, 16,
                     TokenLogprobWire(5, -0.5, [5], [-0.5]), 1.5, ["a", "b"], "h" * 64, "d"),
    PushDecodeParams("t-1", "10.0.0.2", 7001, "p", remote_tls=True),
    KVTransferParams("pull", "p", "10.0.0.2", 7001, "r-1", "l-1", [3], 2, 16,
                     TokenLogprobWire(5), 1.5, ["a"], "h" * 64, remote_tls=True),
    PushPrefillResult("t-1", "p", "10.0.0.2", 7001, 45, 4096,
                      TokenLogprobWire(5, -0.5, [5, 6], [-0.5, -1.5]), PushOverlap(3, 2, 0.25)),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: type(p).__name__)
def test_round_trip(params) -> None:
    wire = params.to_wire()
    assert type(params).from_wire(wire) == params
    assert type(params).from_wire({**wire, "pd_version": PD_VERSION}) == params
    with pytest.raises(ProtocolError, match="pd_version"):
        type(params).from_wire({**wire, "pd_version": PD_VERSION + 1})
    with pytest.raises(ProtocolError, match="unknown"):
        type(params).from_wire({**wire, "surprise": 1})


def test_router_legs_are_what_the_worker_parses() -> None:
    assert parse_kv_transfer_params(pull_prefill_params()) == PrefillLegParams()
    for tls in (False, True):
        prefill = SimpleNamespace(engine_id="p", kv_host="10.0.0.2", kv_port=7001, kv_tls=tls)
        to_p, to_d = push_params("t-1", prefill)  # type: ignore[arg-type]
        assert parse_kv_transfer_params(to_p) == PrefillLegParams(TransferMode.PUSH, "t-1")
        leg = parse_kv_transfer_params(to_d)
        assert leg == PushDecodeParams("t-1", "10.0.0.2", 7001, "p", tls)
        assert isinstance(leg, PushDecodeParams)
        assert leg.prefill_address == ("https://" if tls else "") + "10.0.0.2:7001"


def test_a_plain_kv_endpoint_keeps_the_wire_of_plain_peers() -> None:
    """`remote_tls` is written only when true: a plain mesh's kv_transfer_params are unchanged
    (an older worker, which refuses unknown fields, still reads them)."""
    for params in CASES:
        if isinstance(params, KVTransferParams | PushDecodeParams):
            assert ("remote_tls" in params.to_wire()) is params.remote_tls


def test_api_kind_paths() -> None:
    for kind in ApiKind:
        assert ApiKind.from_path(kind.path) is kind
    with pytest.raises(ValueError):
        ApiKind.from_path("/v1/embeddings")
