"""`pdmesh doctor`: what is installed, what the machine has, and the exact fix when they disagree.

Detection (which accelerators exist), the torch builds that exist for them, and the user's
override (`PDMESH_TORCH_VARIANT`, read by the command, passed in here) are checked against each
other. Pure functions over a `MachineFacts` snapshot, so every decision is unit-testable.
"""

from __future__ import annotations

import glob
import importlib.util
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from enum import StrEnum

TORCH_VERSION = "2.13.0"


class TorchVariant(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    XPU = "xpu"


# The PyTorch wheel index for each variant, and the matching `uv --torch-backend` value.
_INDEX = {
    TorchVariant.CPU: ("https://download.pytorch.org/whl/cpu", "cpu"),
    TorchVariant.CUDA: ("https://download.pytorch.org/whl/cu128", "cu128"),
    TorchVariant.ROCM: ("https://download.pytorch.org/whl/rocm6.4", "rocm6.4"),
    TorchVariant.XPU: ("https://download.pytorch.org/whl/xpu", "xpu"),
}
# Only Linux x86-64 has wheels for every variant; elsewhere only CPU builds are published
# (macOS arm64 ships MPS inside the CPU wheel).
_VARIANTS_BY_PLATFORM = {("Linux", "x86_64"): set(TorchVariant)}


@dataclass(frozen=True)
class MachineFacts:
    """A snapshot of the host: platform, the installed torch build, and accelerators found."""

    system: str
    machine: str
    python: str
    torch_version: str | None  # None: torch does not import
    torch_variant: TorchVariant | None
    accelerators: tuple[TorchVariant, ...]  # GPU families present (never CPU)
    evidence: tuple[str, ...]  # how each accelerator was found


@dataclass(frozen=True)
class Advice:
    """The verdict: which build fits, whether the installed one does, and the commands to fix it."""

    wanted: TorchVariant
    ok: bool
    reason: str
    commands: tuple[str, ...] = ()


class OverrideRefused(ValueError):
    """PDMESH_TORCH_VARIANT names a build that cannot work on this machine."""


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def detect_accelerators() -> tuple[tuple[TorchVariant, ...], tuple[str, ...]]:
    found: list[TorchVariant] = []
    evidence: list[str] = []
    probes = [
        (TorchVariant.CUDA, ["nvidia-smi", "-L"], ["/dev/nvidia[0-9]*"]),
        (TorchVariant.ROCM, ["rocm-smi", "--showproductname"], ["/dev/kfd"]),
        (TorchVariant.XPU, ["xpu-smi", "discovery"], []),
    ]
    for variant, cmd, nodes in probes:
        out = _run(cmd)
        paths = [p for pattern in nodes for p in glob.glob(pattern)]
        if out:
            found.append(variant)
            evidence.append(f"{cmd[0]}: {out.splitlines()[0]}")
        elif paths:
            found.append(variant)
            evidence.append(f"device nodes: {', '.join(sorted(paths)[:3])}")
    return tuple(found), tuple(evidence)


def torch_build() -> tuple[str | None, TorchVariant | None]:
    try:
        import torch
    except Exception:  # noqa: BLE001 - a broken torch install is exactly what doctor reports
        return None, None
    if getattr(torch.version, "hip", None):
        return torch.__version__, TorchVariant.ROCM
    if getattr(torch.version, "cuda", None):
        return torch.__version__, TorchVariant.CUDA
    if getattr(torch.version, "xpu", None) or "+xpu" in torch.__version__:
        return torch.__version__, TorchVariant.XPU
    return torch.__version__, TorchVariant.CPU


def gather_facts() -> MachineFacts:
    version, variant = torch_build()
    accels, evidence = detect_accelerators()
    return MachineFacts(
        system=platform.system(), machine=platform.machine(), python=sys.version.split()[0],
        torch_version=version, torch_variant=variant, accelerators=accels, evidence=evidence,
    )


def available_variants(facts: MachineFacts) -> set[TorchVariant]:
    return _VARIANTS_BY_PLATFORM.get((facts.system, facts.machine), {TorchVariant.CPU})


def fix_commands(variant: TorchVariant) -> tuple[str, ...]:
    index, backend = _INDEX[variant]
    return (
        f"pip install --force-reinstall --index-url {index} torch=={TORCH_VERSION}",
        f"uv pip install --reinstall --torch-backend={backend} torch=={TORCH_VERSION}",
    )


def advise(facts: MachineFacts, override: str | None) -> Advice:
    """Decide which torch build fits; raise OverrideRefused for an override that cannot work."""
    if override:
        try:
            wanted = TorchVariant(override.strip().lower())
        except ValueError:
            names = ", ".join(v.value for v in TorchVariant)
            raise OverrideRefused(f"PDMESH_TORCH_VARIANT={override!r} is not one of {names}") from None
        if wanted not in available_variants(facts):
            raise OverrideRefused(
                f"PDMESH_TORCH_VARIANT={wanted.value}: no {wanted.value} build of torch exists for "
                f"{facts.system}/{facts.machine}")
        if wanted is not TorchVariant.CPU and wanted not in facts.accelerators:
            raise OverrideRefused(
                f"PDMESH_TORCH_VARIANT={wanted.value}: no {wanted.value} device was found on this "
                "host (checked the vendor tools and /dev nodes), so that build could not run")
        why = f"PDMESH_TORCH_VARIANT={wanted.value}"
    else:
        usable = [a for a in facts.accelerators if a in available_variants(facts)]
        wanted = usable[0] if usable else TorchVariant.CPU
        why = f"detected {wanted.value}" if usable else "no accelerator detected"
    if facts.torch_version is None:
        return Advice(wanted, False, f"torch does not import; {why}", fix_commands(wanted))
    if facts.torch_variant is wanted:
        return Advice(wanted, True, f"torch {facts.torch_version} ({wanted.value}) fits: {why}")
    installed = facts.torch_variant
    if installed is None:  # torch_build names a variant whenever torch imports
        raise ValueError(f"MachineFacts has torch {facts.torch_version} but no torch_variant")
    reason = f"installed torch is a {installed.value} build but {why}"
    return Advice(wanted, False, reason, fix_commands(wanted))


def component_status() -> list[tuple[str, str]]:
    """Kernels build and embedded model, each reported without raising."""
    rows: list[tuple[str, str]] = []
    try:
        from kernels import mxfp4

        rows.append(("kernels", str(mxfp4.build_info())))
    except Exception as exc:  # noqa: BLE001 - report, don't crash the doctor
        rows.append(("kernels", f"unavailable: {exc}"))
    rows.append(("dense kernels", _dense_status()))
    rows.append(("prebuilt", _prebuilt_status()))
    if importlib.util.find_spec("shared.model.registry") is None:
        rows.append(("model", "registry missing"))
        return rows
    try:
        from shared.model.registry import model_status

        rows.append(("model", str(model_status())))
    except Exception as exc:  # noqa: BLE001
        rows.append(("model", f"unavailable: {exc}"))
    return rows


def architecture_status(model: str | None, revision: str | None = None) -> list[tuple[str, str]]:
    """The architectures the engine runs, and which one `model` would use (or why it is
    refused); resolving a model name may convert the embedded GGUF once, never downloads."""
    try:
        from shared.model.config import ARCHITECTURES
    except Exception as exc:  # noqa: BLE001 - report, don't crash the doctor
        return [("architectures", f"unavailable: {exc}")]
    rows = [("architectures", ", ".join(f"{arch} ({kind})" for arch, kind in ARCHITECTURES.items()))]
    if model is None:
        return rows
    try:
        from shared.model.loader import read_config
        from shared.model.registry import resolve_model

        config = read_config(resolve_model(model, progress=False, revision=revision))
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer
        return [*rows, ("model arch", f"{model}: REFUSED: {exc}")]
    return [*rows, ("model arch", f"{model}: {config.architecture} ({config.model_type}), "
                                  f"{config.num_layers} layers, head_dim {config.head_dim}")]


def _dense_status() -> str:
    """kernels.dense: the GEMV build, and which bf16 decode path the engine will take."""
    try:
        from kernels import dense

        info = dense.build_info()
        native = dense.decoder() if info.state == "ready" else None
    except Exception as exc:  # noqa: BLE001 - report, don't crash the doctor
        return f"unavailable: {exc}"
    if native is None:
        return f"{info}; bf16 decode path: plain torch layers (no native decoder)"
    return (f"{info}; bf16 decode path: fused decoder layer + native paged attention; "
            f"prefill attention: {native.prefill_attention_kernel}")


def _prebuilt_status() -> str:
    """Where each loaded native library came from, against the configured prebuilt directory
    (PDMESH_KERNELS_DIR, `pdmesh kernels build`). Reads the loads done above; builds nothing."""
    try:
        from kernels.dense import build as dense_build
        from kernels.mxfp4 import build as mxfp4_build

        mxfp4 = [r for v in mxfp4_build.Variant if (r := mxfp4_build.peek(v)) is not None]
        dense = dense_build.peek()
    except Exception as exc:  # noqa: BLE001 - report, don't crash the doctor
        return f"unavailable: {exc}"
    loaded = [(r.recipe.namespace, r) for r in [*mxfp4, *([dense] if dense else [])]]
    dirs = {str(r.config.prebuilt_dir) for _, r in loaded if r.config.prebuilt_dir is not None}
    if not dirs:
        return "none configured (PDMESH_KERNELS_DIR unset): native kernels are JIT-built"
    parts = []
    for name, r in loaded:
        if r.prebuilt and r.library is not None:
            parts.append(f"{name} loaded from {r.library.path}")
        elif r.prebuilt_refused is not None:
            fallback = "JIT-built instead" if r.library is not None else "reference instead"
            parts.append(f"{name} refused ({r.prebuilt_refused}); {fallback}")
    return f"{', '.join(sorted(dirs))}: {'; '.join(parts) or 'nothing loaded yet'}"
