"""`pdmesh doctor` decisions: detection, available builds and the override checked together."""

from __future__ import annotations

import pytest

from services.cli import main
from services.doctor import MachineFacts, OverrideRefused, TorchVariant, advise, fix_commands


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
