"""The compatibility hash: stable, canonical, and sensitive to every factor."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from services.kv_transfer.pull import PullTransfer
from services.kv_transfer.push import PushTransfer
from shared.protocol.codec import KV_PROTOCOL_VERSION
from shared.protocol.compat import (
    CompatFactors,
    ModelKVSpec,
    compat_hash,
    diff_factors,
    fingerprint_files,
)

SPEC = ModelKVSpec("m", "fp", "bfloat16", "bfloat16", 30, 3, 64,
                   ModelKVSpec.rope_items({"rope_theta": 100000.0, "rope_type": "default"}))


def test_mode_comes_from_the_transfer_class() -> None:
    assert CompatFactors.for_transfer(SPEC, PullTransfer).transfer_mode == "pull"
    assert CompatFactors.for_transfer(SPEC, PushTransfer).transfer_mode == "push"
    assert CompatFactors.for_transfer(SPEC, PullTransfer).protocol_version == KV_PROTOCOL_VERSION


def test_hash_is_stable_and_canonical() -> None:
    f = CompatFactors.for_transfer(SPEC, PullTransfer)
    assert compat_hash(f) == compat_hash(dataclasses.replace(f)) == f.hash
    # RoPE given in another key order hashes the same.
    rope2 = ModelKVSpec.rope_items({"rope_type": "default", "rope_theta": 100000.0})
    assert compat_hash(dataclasses.replace(f, rope=rope2)) == f.hash
    assert list(f.to_wire()) == sorted(f.to_wire())


ALTERED = {
    "protocol_version": KV_PROTOCOL_VERSION + 1, "model_id": "other", "weights_fingerprint": "fp2",
    "dtype": "float32", "kv_dtype": "float32", "num_layers": 31, "num_kv_heads": 4,
    "head_dim": 128, "rope": ModelKVSpec.rope_items({"rope_theta": 10000.0}),
    "kv_layout": "other-layout", "transfer_mode": "push",
}


def test_every_factor_is_covered_by_the_test() -> None:
    assert set(ALTERED) == {f.name for f in dataclasses.fields(CompatFactors)}


@pytest.mark.parametrize("name", sorted(ALTERED))
def test_hash_is_sensitive_to_every_factor(name: str) -> None:
    f = CompatFactors.for_transfer(SPEC, PullTransfer)
    g = dataclasses.replace(f, **{name: ALTERED[name]})
    assert g.hash != f.hash
    diffs = diff_factors(f, g.to_wire())
    assert [d.name for d in diffs] == [name]
    assert repr(getattr(f, name) if name != "rope" else dict(f.rope)) in str(diffs[0])


def test_diff_tolerates_garbage_and_unknown_factors() -> None:
    f = CompatFactors.for_transfer(SPEC, PullTransfer)
    assert [d.name for d in diff_factors(f, "garbage")] == ["factors"]
    diffs = diff_factors(f, {**f.to_wire(), "new_factor": 1})
    assert [(d.name, d.local) for d in diffs] == [("new_factor", "<absent>")]


def test_sha256_over_sorted_msgpack() -> None:
    import msgpack

    f = CompatFactors.for_transfer(SPEC, PullTransfer)
    raw = {k: getattr(f, k) for k in sorted(ALTERED)}
    raw["rope"] = dict(sorted(f.rope))
    expected = hashlib.sha256(msgpack.packb(dict(sorted(raw.items())), use_bin_type=True))
    assert f.hash == expected.hexdigest()


def test_fingerprint_files_sees_contents(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"\x00" * 100)
    b.write_bytes(b"\x00" * 99 + b"\x01")
    one = fingerprint_files([a])
    assert one == fingerprint_files([a]) and one != fingerprint_files([b])


def test_pipeline_layout_stays_out_of_the_hash() -> None:
    """Pipeline size and stage layers are negotiated after the hash matched (handshake)."""
    names = {f.name for f in dataclasses.fields(CompatFactors)}
    assert not names & {"pp_size", "layer_ranges", "layer_start", "layer_end", "block_size"}
    assert KV_PROTOCOL_VERSION >= 2  # the version that added per-stage layer_ranges
