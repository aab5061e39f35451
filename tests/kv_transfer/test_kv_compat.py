"""The compatibility hash: stable, canonical, and sensitive to every factor."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from services.kv_transfer.pull import PullTransfer
from services.kv_transfer.push import PushTransfer
from shared.config import EngineConfig
from shared.engine.kv_spec import kv_spec_of, weight_transforms
from shared.protocol.codec import KV_PROTOCOL_VERSION
from shared.protocol.compat import (
    CompatFactors,
    ModelKVSpec,
    WeightTransforms,
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
    "weight_transforms": WeightTransforms(quantization="mxfp4").items(),
    "dtype": "float32", "kv_dtype": "float32", "num_layers": 31, "num_kv_heads": 4,
    "head_dim": 128, "rope": ModelKVSpec.rope_items({"rope_theta": 10000.0}),
    "kv_layout": "other-layout", "transfer_mode": "push", "attention_windows": "4096,full",
}


MAP_FACTORS = ("rope", "weight_transforms")  # sorted (key, value) pairs, a map on the wire


def test_every_factor_is_covered_by_the_test() -> None:
    assert set(ALTERED) == {f.name for f in dataclasses.fields(CompatFactors)}


@pytest.mark.parametrize("name", sorted(ALTERED))
def test_hash_is_sensitive_to_every_factor(name: str) -> None:
    f = CompatFactors.for_transfer(SPEC, PullTransfer)
    g = dataclasses.replace(f, **{name: ALTERED[name]})
    assert g.hash != f.hash
    diffs = diff_factors(f, g.to_wire())
    assert [d.name for d in diffs] == [name]
    value = getattr(f, name)
    if name not in MAP_FACTORS:
        assert repr(value) in str(diffs[0])
        return
    # A map factor names only its differing keys, each with both values.
    mine, theirs = dict(value), dict(ALTERED[name])
    keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    assert keys and diffs[0].local == repr({k: mine.get(k, "<absent>") for k in keys})
    assert diffs[0].remote == repr({k: theirs.get(k, "<absent>") for k in keys})


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
    raw["weight_transforms"] = dict(sorted(f.weight_transforms))
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


# --- Run-time weight transforms (quantisation) are factors --------------------------------

# Every EngineConfig field, by whether it changes the KV bytes a prompt produces. A new field
# fails test_every_engine_setting_is_classified until it is put in one of these: a transform
# of the weights goes into WeightTransforms (shared/protocol/compat.py, set in
# shared/engine/kv_spec.py) and HASHED.
HASHED = {  # field -> a value that must change the hash (from EngineConfig's defaults)
    "dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "quantization": "mxfp4",
    "quantize_lm_head": True,  # with quantization="mxfp4", against mxfp4 without the head
    "quant_encoder": "ocp",  # with quantization="mxfp4", against the default (mse) exponents
    # with quantization="mxfp4": a prompt of up to 32 tokens prefills through the fused kernel,
    # whose int8 activations change the KV bytes
    "quant_activations": "int8",
}
# The checkpoint: the weights fingerprint and the served name (revision and hf_hub_cache pick
# which snapshot of an org/name model is loaded, like model itself).
COVERED_BY_THE_CHECKPOINT = {"model", "revision", "hf_hub_cache"}
KV_NEUTRAL = {  # field -> another value that must leave the hash alone
    "max_model_len": 128, "block_size": 32, "kv_cache_memory_bytes": 1 << 20,
    "max_num_seqs": 2, "max_num_batched_tokens": 64, "enable_prefix_caching": False,
    "enable_chunked_prefill": False, "num_threads": 1, "seed": 7, "cache_dir": Path("/elsewhere"),
    # The kernel tier changes the order of fp32 sums, not the KV format or its meaning: an avx2
    # prefill and an avx512_bf16 decode agree within the native-vs-plain tolerance
    # (tests/engine/test_native_decode.py), as two machines of different CPU kinds must.
    "kernel_tier": "reference",
    # Structured output masks the sampler; the KV of a prompt is the same either way.
    "grammar_cache_size": 2, "grammar_compile_timeout_s": 1.0,
    # Speculation runs on the decode side only, after the KV has moved: the KV a prefill sends
    # is the target's either way (a decode writes its drafts' KV into its own cache and rolls
    # rejected ones back locally; a draft model is prefilled there from the prompt tokens).
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
    # Threads lent between sibling workers change the speed of a step, not its KV.
    "core_share": Path("/dev/shm/pdmesh-cores-test"),
    # The screened greedy head picks the token the full head's argmax picks, after the KV is
    # written (tests/engine/test_greedy_screen.py).
    "greedy_screen": False,
}


@pytest.fixture(scope="module")
def model_config(ckpt: Path):
    from shared.model.config import ModelConfig
    from shared.model.loader import read_json

    return ModelConfig.from_hf(read_json(ckpt / "config.json"))


def _hash(engine: EngineConfig, model_config) -> str:
    spec = kv_spec_of("m", "fp", engine, model_config)
    return CompatFactors.for_transfer(spec, PullTransfer).hash


def test_every_engine_setting_is_classified() -> None:
    classified = set(HASHED) | COVERED_BY_THE_CHECKPOINT | set(KV_NEUTRAL)
    assert classified == {f.name for f in dataclasses.fields(EngineConfig)}


@pytest.mark.parametrize("name", sorted(HASHED))
def test_settings_that_change_kv_bytes_change_the_hash(name: str, model_config) -> None:
    with_quant = ("quantize_lm_head", "quant_encoder", "quant_activations")
    base = EngineConfig(quantization="mxfp4") if name in with_quant else EngineConfig()
    changed = dataclasses.replace(base, **{name: HASHED[name]})
    assert _hash(changed, model_config) != _hash(base, model_config)


@pytest.mark.parametrize("name", sorted(KV_NEUTRAL))
def test_settings_that_leave_kv_bytes_alone_leave_the_hash(name: str, model_config) -> None:
    base = EngineConfig()
    changed = dataclasses.replace(base, **{name: KV_NEUTRAL[name]})
    assert _hash(changed, model_config) == _hash(base, model_config)


def test_quantised_and_dense_workers_differ_in_one_named_factor(model_config) -> None:
    dense = kv_spec_of("m", "fp", EngineConfig(), model_config)
    quant = kv_spec_of("m", "fp", EngineConfig(quantization="mxfp4"), model_config)
    f, g = (CompatFactors.for_transfer(s, PullTransfer) for s in (dense, quant))
    assert f.hash != g.hash
    (diff,) = diff_factors(f, g.to_wire())
    assert diff.name == "weight_transforms"
    assert "'quantization': 'none'" in diff.local and "'quantization': 'mxfp4'" in diff.remote


@pytest.mark.parametrize("quantization, head, encoder, activations",
                         [(None, False, None, "float"), ("mxfp4", False, None, "float"),
                          ("mxfp4", True, "ocp", "float"), ("mxfp4", False, None, "int8")])
def test_weight_transforms_say_what_the_engine_loaded(ckpt: Path, quantization: str | None,
                                                      head: bool, encoder: str | None,
                                                      activations: str) -> None:
    """The factor is derived from the configuration; the loaded model is the reference."""
    from shared.engine.engine import LLMEngine
    from shared.model.quant import MXFP4Linear

    config = EngineConfig(model=str(ckpt), quantization=quantization, quantize_lm_head=head,
                          quant_encoder=encoder, quant_activations=activations,
                          kv_cache_memory_bytes=4 << 20, num_threads=1)
    model = LLMEngine.from_config(config).runner.model
    decoder_quantised = any(isinstance(m, MXFP4Linear) for m in model.layers.modules())
    encoders = {m.encoder for m in model.modules() if isinstance(m, MXFP4Linear)}
    acts = {m.activations for m in model.modules() if isinstance(m, MXFP4Linear)}
    loaded = WeightTransforms(quantization="mxfp4" if decoder_quantised else "none",
                              lm_head="mxfp4" if isinstance(model.lm_head, MXFP4Linear)
                              else "dense",
                              encoder=str(encoders.pop()) if encoders else "none",
                              activations=str(acts.pop()) if acts else "float")
    assert not encoders and not acts
    assert weight_transforms(config) == loaded


# --- Sliding windows are a factor --------------------------------------------------------------

def _windowed(base, windows: tuple[int | None, ...]):
    return dataclasses.replace(base, layer_windows=windows)


def test_a_different_sliding_window_changes_the_hash(model_config) -> None:
    """A prefill and a decode whose layers attend over different windows compute different KV
    past the first window: they never pair, and the refusal names the factor."""
    n = model_config.num_layers
    full = _hash(EngineConfig(), model_config)
    w8 = _windowed(model_config, (8,) * n)
    assert _hash(EngineConfig(), w8) != full
    assert _hash(EngineConfig(), w8) != _hash(EngineConfig(), _windowed(model_config, (16,) * n))
    mixed = _windowed(model_config, (None,) * (n - 1) + (8,))
    assert _hash(EngineConfig(), mixed) not in (full, _hash(EngineConfig(), w8))
    f, g = (CompatFactors.for_transfer(kv_spec_of("m", "fp", EngineConfig(), c), PullTransfer)
            for c in (model_config, w8))
    (diff,) = diff_factors(f, g.to_wire())
    assert diff.name == "attention_windows" and "full" in diff.local and "8" in diff.remote


def test_windows_factor_names_each_layer() -> None:
    assert ModelKVSpec.windows_factor([]) == ModelKVSpec.windows_factor([None, None]) == "full"
    assert ModelKVSpec.windows_factor([None, 4096]) == "full,4096"
    assert ModelKVSpec.windows_factor([7, 7]) == "7,7"


_FAMILY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "sliding_window": 8}
FAMILIES = {  # families whose own configs place the windows (HF's default layer patterns)
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]},
    "gemma3": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]},
    "gpt_oss": {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                "num_local_experts": 4},
    "qwen3_moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                  "use_sliding_window": True},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_windows_are_the_one_attention_windows_factor(family: str) -> None:
    """Gemma, gpt-oss and Qwen3-MoE windows are ModelConfig.layer_windows like everyone's:
    a different window differs in attention_windows alone (no family key repeats it in the
    rope factor, so one change is never counted twice)."""
    from shared.model.config import ModelConfig

    def factors(window: int) -> CompatFactors:
        config = ModelConfig.from_hf({**_FAMILY, **FAMILIES[family], "sliding_window": window})
        assert any(w == window for w in config.layer_windows)
        spec = kv_spec_of("m", "fp", EngineConfig(), config)
        assert spec.attention_windows == ModelKVSpec.windows_factor(config.layer_windows)
        assert not [k for k, _ in spec.rope if "window" in k or "layer_types" in k]
        return CompatFactors.for_transfer(spec, PullTransfer)

    w8, w16 = factors(8), factors(16)
    (diff,) = diff_factors(w8, w16.to_wire())
    assert diff.name == "attention_windows" and "8" in diff.local and "16" in diff.remote
