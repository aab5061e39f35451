"""WorkerConfig from flags and environment, sizes, and the shared auth/lifecycle pieces."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kernels.tier import TIER_CHOICES, Tier
from services.common.middleware import ApiKeyAuth, api_prefix_predicate
from services.common.units import parse_size
from services.worker.config import KVLoadFailurePolicy, WorkerConfig, add_arguments
from shared.config import EngineConfig, auto_dtype
from shared.protocol.pd import Role


def parse(argv: list[str], environ: dict[str, str] | None = None) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return WorkerConfig.from_args(parser.parse_args(argv), environ or {})


def test_flags_reach_engine_config() -> None:
    c = parse(["--model", "m", "--dtype", "bfloat16", "--max-model-len", "1024", "--block-size", "32",
               "--kv-cache-memory", "64MiB", "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
               "--no-prefix-caching", "--no-chunked-prefill", "--threads", "2", "--port", "9000",
               "--max-body-size", "1MiB", "--max-queue", "3", "--drain-grace-seconds", "2.5",
               "--served-model-name", "a", "b"])
    e = c.engine
    assert (e.model, e.dtype, e.max_model_len, e.block_size) == ("m", "bfloat16", 1024, 32)
    assert e.kv_cache_memory_bytes == 64 * 2**20
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.num_threads) == (4, 512, 2)
    assert not e.enable_prefix_caching and not e.enable_chunked_prefill
    assert (c.port, c.max_body_size, c.max_queue, c.drain_grace_seconds) == (9000, 2**20, 3, 2.5)
    assert c.model_names == ("a", "b") and c.served_model_name == "a"
    assert c.admission_capacity == 7
    assert c.role is Role.MIXED


def test_quantization_flags() -> None:
    e = parse(["--quantization", "mxfp4", "--quantize-lm-head"]).engine
    assert (e.quantization, e.quantize_lm_head) == ("mxfp4", True)
    assert not parse(["--quantization", "mxfp4"]).engine.quantize_lm_head
    with pytest.raises(ValueError, match="needs quantization"):
        parse(["--quantize-lm-head"])
    assert parse(["--quantization", "mxfp4"]).engine.quant_encoder is None  # the default
    e = parse(["--quantization", "mxfp4", "--quant-encoder", "ocp"]).engine
    assert e.quant_encoder == "ocp"
    with pytest.raises(SystemExit):
        parse(["--quantization", "mxfp4", "--quant-encoder", "best"])
    # GPTQ needs calibration text: refused at load, naming the command that writes it
    with pytest.raises(ValueError, match="pdmesh quantize IN OUT --method gptq"):
        parse(["--quantization", "mxfp4", "--quant-encoder", "gptq"])


def test_defaults() -> None:
    c = parse([])
    assert c.max_body_size == 4 * 2**20
    assert c.served_model_name == c.engine.model
    assert c.api_keys == ()


def test_engine_failure_drain_flag() -> None:
    assert parse([]).engine_failure_drain_seconds == WorkerConfig().engine_failure_drain_seconds
    assert parse(["--engine-failure-drain-seconds", "0.5"]).engine_failure_drain_seconds == 0.5
    with pytest.raises(ValueError, match="engine_failure_drain_seconds"):
        parse(["--engine-failure-drain-seconds", "-1"])


def test_api_keys_flags_win_over_env() -> None:
    assert parse([], {"PDMESH_API_KEY": "x, y,"}).api_keys == ("x", "y")
    assert parse(["--api-key", "a", "--api-key", "b"], {"PDMESH_API_KEY": "x"}).api_keys == ("a", "b")


def test_speculative_config_flag_wins_over_env() -> None:
    """compose hands the decode workers PDMESH_SPECULATIVE_CONFIG; empty means off."""
    env = {"PDMESH_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 3}'}
    spec = parse([], env).engine.speculative_config
    assert spec is not None and (spec.method.value, spec.num_speculative_tokens) == ("ngram", 3)
    assert parse([], {"PDMESH_SPECULATIVE_CONFIG": ""}).engine.speculative_config is None
    flag = '{"method": "ngram", "num_speculative_tokens": 5}'
    spec = parse(["--speculative-config", flag], env).engine.speculative_config
    assert spec is not None and spec.num_speculative_tokens == 5
    with pytest.raises(ValueError, match="method"):
        parse([], {"PDMESH_SPECULATIVE_CONFIG": '{"method": "nope"}'})


def test_revision_flag_and_hub_cache_env_reach_engine_config(tmp_path: Path) -> None:
    e = parse(["--model", "org/name", "--revision", "v1.0"],
              {"HF_HOME": str(tmp_path / "hf")}).engine
    assert (e.model, e.revision, e.hf_hub_cache) == ("org/name", "v1.0", tmp_path / "hf" / "hub")
    e = parse([], {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}).engine
    assert (e.revision, e.hf_hub_cache) == (None, tmp_path / "hub")


def test_kernel_tier_flag_wins_over_env() -> None:
    assert parse([]).engine.kernel_tier == "auto"
    assert parse([], {"PDMESH_KERNEL_TIER": "avx2"}).engine.kernel_tier == "avx2"
    assert parse([], {"PDMESH_KERNEL_TIER": " AVX512 "}).engine.kernel_tier == "avx512"
    assert parse([], {"PDMESH_KERNEL_TIER": ""}).engine.kernel_tier == "auto"
    for tier in TIER_CHOICES:
        got = parse(["--kernel-tier", tier], {"PDMESH_KERNEL_TIER": "reference"}).engine
        assert got.kernel_tier == tier


def test_invalid_kernel_tier_is_a_clear_error_naming_the_choices(
        capsys: pytest.CaptureFixture[str]) -> None:
    choices = ", ".join(TIER_CHOICES[1:])
    with pytest.raises(ValueError, match=f"PDMESH_KERNEL_TIER='avx9'.*expected auto or one of "
                                         f"{choices}"):
        parse([], {"PDMESH_KERNEL_TIER": "avx9"})
    with pytest.raises(SystemExit):
        parse(["--kernel-tier", "avx9"])
    err = capsys.readouterr().err
    assert "--kernel-tier: invalid choice: 'avx9'" in err
    assert all(tier in err for tier in TIER_CHOICES)
    with pytest.raises(ValueError, match=f"unknown kernel tier 'fast'; expected auto or one of "
                                         f"{choices}"):
        EngineConfig(kernel_tier="fast")


def test_engine_config_kernel_tier_defaults_to_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDMESH_KERNEL_TIER", "Portable")
    assert EngineConfig().kernel_tier == "portable"  # LLM(), benchmarks: every EngineConfig
    assert EngineConfig(kernel_tier="avx2").kernel_tier == "avx2"
    monkeypatch.delenv("PDMESH_KERNEL_TIER")
    assert EngineConfig().kernel_tier == "auto"
    monkeypatch.setenv("PDMESH_KERNEL_TIER", "bogus")
    with pytest.raises(ValueError, match="PDMESH_KERNEL_TIER='bogus'"):
        EngineConfig()
    parser = argparse.ArgumentParser()
    add_arguments(parser)  # --help still works: its defaults do not read the env


def test_serve_refuses_a_bad_env_tier_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    monkeypatch.setenv("PDMESH_KERNEL_TIER", "avx9")
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "pdmesh serve: PDMESH_KERNEL_TIER='avx9': unknown kernel tier" in err
    assert "Traceback" not in err


# The dtype `auto` stands for, per CPU kind (cpu tier, cap): bf16 where a native tier decodes.
@pytest.mark.parametrize("cpu, cap, native, dtype", [
    (Tier.AVX512_BF16, "auto", True, "bfloat16"),  # AMD Zen 4/5
    (Tier.AVX512, "auto", True, "bfloat16"),  # Intel AVX-512 without bf16 dot products
    (Tier.AVX2, "auto", True, "bfloat16"),  # AMD Zen 2/3
    (Tier.AVX512_BF16, "avx2", True, "bfloat16"),
    (Tier.PORTABLE, "auto", True, "float32"),  # no SIMD tier: plain torch decodes
    (Tier.AVX512_BF16, "portable", True, "float32"),
    (Tier.AVX2, "reference", True, "float32"),
    (Tier.AVX512_BF16, "auto", False, "float32"),  # a pipeline stage: plain torch layers
])
def test_auto_dtype_per_cpu_kind(cpu: Tier, cap: str, native: bool, dtype: str) -> None:
    assert auto_dtype(cap, native_decode=native, cpu=cpu) == dtype


def test_dtype_defaults_to_auto_resolved_for_this_cpu() -> None:
    assert parse([]).engine.dtype == auto_dtype("auto")
    assert parse(["--kernel-tier", "reference"]).engine.dtype == "float32"
    assert parse([], {"PDMESH_KERNEL_TIER": "reference"}).engine.dtype == "float32"
    assert parse(["--pp-size", "2"]).engine.dtype == "float32"
    for dtype in ("float32", "bfloat16"):
        assert parse(["--dtype", dtype, "--kernel-tier", "reference"]).engine.dtype == dtype
    assert EngineConfig(dtype="auto", kernel_tier="reference").dtype == "float32"
    assert EngineConfig(dtype="auto", kernel_tier="avx2").dtype == auto_dtype("avx2")
    with pytest.raises(ValueError, match="dtype must be auto, float32 or bfloat16"):
        EngineConfig(dtype="float16")


def test_roles_and_kv_flags() -> None:
    assert {r.value for r in Role} == {"mixed", "prefill", "decode"}
    assert parse([]).kv is None and parse([]).transfer_mode is None
    c = parse(["--role", "decode", "--transfer-mode", "push", "--kv-port", "0", "--kv-host", "0.0.0.0",
               "--kv-lease-seconds", "5", "--kv-allow-incompatible",
               "--kv-load-failure-policy", "recompute"], {"PDMESH_KV_SECRET": "s" * 20})
    assert c.role is Role.DECODE and c.kv is not None
    assert (c.kv.role, c.kv.mode, c.kv.port, c.kv.host) == ("decode", "push", 0, "0.0.0.0")
    assert c.kv.lease_seconds == 5 and c.kv.allow_incompatible and c.kv.secret == b"s" * 20
    assert c.kv_load_failure_policy is KVLoadFailurePolicy.RECOMPUTE and c.transfer_mode == "push"
    assert parse(["--role", "prefill"]).kv_load_failure_policy is KVLoadFailurePolicy.FAIL
    with pytest.raises(ValueError, match="needs KV-transfer settings"):
        WorkerConfig(role=Role.PREFILL)


def test_kv_keepalive_flag() -> None:
    kv = parse(["--role", "decode", "--kv-keepalive-seconds", "2"]).kv
    assert kv is not None and kv.keepalive_s == 2
    assert parse(["--role", "decode"]).kv.keepalive_s == 15.0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="keepalive must be > 0"):
        parse(["--role", "decode", "--kv-keepalive-seconds", "0"])


@pytest.mark.parametrize("text,value", [("4096", 4096), ("256MiB", 256 * 2**20), ("4MB", 4 * 10**6),
                                        ("1.5GiB", int(1.5 * 2**30)), ("2k", 2048), ("10 B", 10)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "-1", "4 parsecs", "1e3"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_api_key_auth_checks_every_key_and_scheme() -> None:
    auth = ApiKeyAuth(["k1", "k2"], api_prefix_predicate(["/v1", "/tokenize"]))
    assert auth.check("Bearer k1") and auth.check("bearer k2")
    assert not auth.check("Bearer k3") and not auth.check("Token k1") and not auth.check(None)
    assert not auth.check("Bearer ") and not auth.check("Bearerk1")
    guarded = api_prefix_predicate(["/v1", "/tokenize"])
    assert guarded("/v1/models") and guarded("/v1") and guarded("/tokenize")
    assert not guarded("/v10") and not guarded("/health") and not guarded("/metrics")
