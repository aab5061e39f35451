"""`pdmesh doctor` decisions: detection, available builds and the override checked together."""

from __future__ import annotations

import pytest

from kernels.tier import Tier, max_tier
from services.cli import main
from services.doctor import MachineFacts, OverrideRefused, TorchVariant, advise, fix_commands
from shared.config import auto_dtype
from shared.kernel_tiers import (
    active_backend,
    backend_tier,
    cpu_tier,
    read_cpu_flags,
    tier_of_flags,
)


def facts(variant: TorchVariant | None, accels=(), system="Linux", machine="x86_64") -> MachineFacts:
    return MachineFacts(system, machine, "3.11.7", "2.13.0" if variant else None, variant,
                        tuple(accels), ())


def test_cpu_torch_on_cpu_host_fits():
    adv = advise(facts(TorchVariant.CPU), None)
    assert adv.ok and adv.wanted is TorchVariant.CPU and adv.commands == ()


def test_cuda_torch_without_gpu_prints_cpu_fix():
    adv = advise(facts(TorchVariant.CUDA), None)
    assert not adv.ok and adv.wanted is TorchVariant.CPU
    assert adv.commands == fix_commands(TorchVariant.CPU)
    assert any(c.startswith("pip install") and "whl/cpu" in c and "torch==2.13.0" in c
               for c in adv.commands)
    assert any(c.startswith("uv pip install") and "--torch-backend=cpu" in c for c in adv.commands)


def test_cpu_torch_on_gpu_host_prints_cuda_fix():
    adv = advise(facts(TorchVariant.CPU, [TorchVariant.CUDA]), None)
    assert not adv.ok and adv.wanted is TorchVariant.CUDA
    assert any("cu128" in c for c in adv.commands)


def test_override_cpu_on_gpu_host_is_accepted():
    adv = advise(facts(TorchVariant.CPU, [TorchVariant.CUDA]), "cpu")
    assert adv.ok and "PDMESH_TORCH_VARIANT" in adv.reason


@pytest.mark.parametrize("override, accels, machine, words", [
    ("cuda", (), "x86_64", "no cuda device"),
    ("rocm", (TorchVariant.CUDA,), "x86_64", "no rocm device"),
    ("cuda", (TorchVariant.CUDA,), "aarch64", "no cuda build"),
    ("tpu", (), "x86_64", "not one of"),
])
def test_impossible_override_is_refused_with_reason(override, accels, machine, words):
    with pytest.raises(OverrideRefused, match=words):
        advise(facts(TorchVariant.CPU, accels, machine=machine), override)


def test_missing_torch_gets_install_commands():
    adv = advise(facts(None), None)
    assert not adv.ok and adv.commands == fix_commands(TorchVariant.CPU)


def test_doctor_command_runs(capsys, monkeypatch):
    monkeypatch.delenv("PDMESH_TORCH_VARIANT", raising=False)
    rc = main(["doctor", "--skip-components"])
    out = capsys.readouterr().out
    assert "torch" in out and "accelerators" in out
    assert rc in (0, 1)


def test_doctor_command_refuses_bad_override(capsys, monkeypatch):
    monkeypatch.setenv("PDMESH_TORCH_VARIANT", "xpu")
    assert main(["doctor", "--skip-components"]) == 2
    assert "REFUSED" in capsys.readouterr().out


# ---- the kernel tier: the CPU's, the cap, each library's active one ------------------------
_AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}


@pytest.mark.parametrize("flags, tier", [
    (_AVX512 | {"avx512_bf16"}, Tier.AVX512_BF16),  # AMD Zen 4/5
    (_AVX512 | {"avx512_vbmi"}, Tier.AVX512),  # Intel Ice Lake: no bf16 dot products
    (_AVX2, Tier.AVX2),  # AMD Zen 2/3
    (_AVX2 - {"fma"}, Tier.PORTABLE),  # every flag of a tier is needed
    ((_AVX2 | {"avx512_bf16"}) - {"avx512f"}, Tier.AVX2),
    (set(), Tier.PORTABLE),
])
def test_cpu_tier_from_flags(flags: set[str], tier: Tier) -> None:
    assert tier_of_flags(flags) is tier


def test_cpu_flags_are_read_from_cpuinfo(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma f16c\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(info) == {"fpu", "avx2", "fma", "f16c"}
    assert read_cpu_flags(tmp_path / "missing") is None


@pytest.mark.parametrize("backend, tier", [
    ("avx512_bf16", Tier.AVX512_BF16), ("avx512_fma", Tier.AVX512), ("avx512", Tier.AVX512),
    ("avx2", Tier.AVX2), ("scalar", Tier.PORTABLE), ("reference", Tier.REFERENCE)])
def test_backend_names_map_onto_the_ladder(backend: str, tier: Tier) -> None:
    assert backend_tier(backend) is tier


def test_active_backend_is_the_fastest_within_the_cap() -> None:
    available = ["avx512_bf16", "avx512_fma", "reference"]
    assert active_backend(available, Tier.AVX512_BF16) == "avx512_bf16"
    assert active_backend(available, Tier.AVX512) == "avx512_fma"
    assert active_backend(available, Tier.AVX2) == "reference"


def test_doctor_shows_the_cpu_tier_and_the_cap_from_flag_or_env(capsys, monkeypatch):
    monkeypatch.delenv("PDMESH_TORCH_VARIANT", raising=False)
    monkeypatch.setenv("PDMESH_KERNEL_TIER", "avx2")
    assert main(["doctor", "--skip-components"]) in (0, 1)
    out = capsys.readouterr().out
    line = _tier_line(out)
    assert f"cpu={cpu_tier().label} cap=avx2" in line and "requested: avx2" in line
    assert f"dtype auto   {auto_dtype('avx2')} " in out
    assert main(["doctor", "--skip-components", "--kernel-tier", "reference"]) in (0, 1)
    assert "cap=reference" in _tier_line(capsys.readouterr().out)  # the flag wins


def test_doctor_refuses_a_bad_kernel_tier_naming_the_choices(capsys, monkeypatch):
    monkeypatch.delenv("PDMESH_TORCH_VARIANT", raising=False)
    monkeypatch.setenv("PDMESH_KERNEL_TIER", "avx9")
    assert main(["doctor", "--skip-components"]) == 2
    line = _tier_line(capsys.readouterr().out)
    assert "REFUSED" in line and "PDMESH_KERNEL_TIER='avx9'" in line
    assert "expected auto or one of avx512_bf16, avx512, avx2, portable, reference" in line


@pytest.mark.parametrize("requested", ["auto", "avx2", "reference"])
def test_doctor_shows_each_library_active_tier(capsys, monkeypatch, requested):
    """What doctor prints is what a kernel lookup under that cap resolves to."""
    from kernels import dense, mxfp4

    monkeypatch.delenv("PDMESH_TORCH_VARIANT", raising=False)
    monkeypatch.delenv("PDMESH_KERNEL_TIER", raising=False)
    assert main(["doctor", "--kernel-tier", requested]) in (0, 1)
    line = _tier_line(capsys.readouterr().out)
    for name, lib in (("dense", dense), ("mxfp4", mxfp4)):
        backend = lib.kernel_path(None).backend  # the cap doctor set is still in force
        assert f"{name}={backend}" in line
        assert backend_tier(backend) <= min(cpu_tier(), max_tier())


def _tier_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.startswith("kernel tier")]
    return line


def test_cpu_tier_agrees_with_the_kernel_library_own_detection():
    """/proc/cpuinfo (shared.kernel_tiers) against __builtin_cpu_supports (kernels.dense)."""
    from kernels import dense

    info = dense.build_info()
    assert info.state == "ready", info.error
    detected = Tier.parse(info.cpu_tier)  # dense's fastest tier: reference below avx2
    if detected >= Tier.AVX2:
        assert cpu_tier() is detected
    else:
        assert cpu_tier() < Tier.AVX2


# ---- architectures: what the engine runs, and what a given --model would use ----------------

def test_doctor_lists_architectures_and_names_the_models(capsys, monkeypatch, make_checkpoint,
                                                         tmp_path):
    from shared.model.config import ARCHITECTURES

    monkeypatch.delenv("PDMESH_TORCH_VARIANT", raising=False)
    qwen3 = make_checkpoint(arch="qwen3", head_dim=24)
    main(["doctor", "--skip-components", "--model", str(qwen3)])
    out = capsys.readouterr().out
    listed = next(line for line in out.splitlines() if line.startswith("architectures"))
    assert all(f"{arch} ({kind})" in listed for arch, kind in ARCHITECTURES.items())
    row = next(line for line in out.splitlines() if line.startswith("model arch"))
    assert "Qwen3ForCausalLM (qwen3)" in row and "head_dim 24" in row, row
    # An architecture the engine does not run is refused by name, not loaded as another.
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], '
                                      '"model_type": "gpt2"}')
    main(["doctor", "--skip-components", "--model", str(gpt2)])
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("model arch"))
    assert "REFUSED" in row and "GPT2LMHeadModel" in row, row
