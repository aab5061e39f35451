"""The Docker image's promise, without Docker: kernels built by `pdmesh kernels build` in an
environment with a compiler run natively in a fresh one whose PATH has no compiler or ninja.

The build environment is this test's own (it reuses the JIT cache, so unchanged sources are
not recompiled). The fresh one is a new virtualenv that reuses this interpreter's
site-packages through a .pth file, with PATH = its own bin/ only and empty caches, as the
image's runtime stage: the JIT build is impossible there, so whatever runs natively came from
the prebuilt directory. The reference for what it should run is the build environment
itself: same backends chosen, and bit-identical outputs from the same machine code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import prebuilt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("prebuilt_probe.py")
LIBRARIES = ("pdmesh_mxfp4", "pdmesh_dense")


@dataclass(frozen=True)
class Probe:
    """One prebuilt_probe.py run: its JSON report, the kernels' outputs and its stderr."""

    doc: dict[str, Any]
    outputs: dict[str, torch.Tensor]
    stderr: str

    def library(self, name: str) -> dict[str, Any]:
        return self.doc["libraries"][name]


def _run(cmd: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _probe(python: str, env: dict[str, str], out: Path) -> Probe:
    out.mkdir(parents=True)
    proc = _run([python, str(PROBE), str(out)], env)
    return Probe(json.loads((out / "probe.json").read_text()),
                 torch.load(out / "outputs.pt"), proc.stderr)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prebuilt")


@pytest.fixture(scope="module")
def build_env() -> dict[str, str]:
    """This environment (compiler, ninja, the JIT cache), never reading a prebuilt directory,
    with the tier cap left at auto."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PDMESH_KERNELS_DIR", "PDMESH_KERNEL_TIER")}
    return {**env, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def artefacts(work: Path, build_env: dict[str, str]) -> Path:
    """`pdmesh kernels build --out DIR`, once for the module."""
    out = work / "kernels"
    _run([sys.executable, "-m", "services.cli", "kernels", "build", "--out", str(out)], build_env,
         timeout=540)
    return out


@pytest.fixture(scope="module")
def fresh_python(work: Path) -> str:
    """A new virtualenv on this interpreter's site-packages (a .pth runs site.addsitedir, so
    the packages' own .pth files apply too); returns its python."""
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    purelib = sysconfig.get_paths()["purelib"]
    (site / "pdmesh-test-base.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
    return str(venv / "bin" / "python")


def _fresh_env(fresh_python: str, kernels_dir: Path, cache: Path) -> dict[str, str]:
    """The runtime stage: PATH is the venv's bin/ alone, caches empty, nothing inherited."""
    cache.mkdir(parents=True)
    return {"PATH": str(Path(fresh_python).parent), "HOME": str(cache), "PYTHONPATH": str(REPO),
            "PDMESH_CACHE": str(cache), "TORCH_EXTENSIONS_DIR": str(cache / "torch_extensions"),
            "PDMESH_KERNELS_DIR": str(kernels_dir), "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture(scope="module")
def installed(artefacts: Path, fresh_python: str) -> Path:
    """The artefacts copied into the fresh environment, as the image's runtime stage does."""
    target = Path(fresh_python).parents[1] / "share" / "pdmesh" / "kernels"
    shutil.copytree(artefacts, target)
    return target


def test_the_build_writes_both_libraries_and_a_manifest(artefacts: Path) -> None:
    manifest = prebuilt.Manifest.read(artefacts)
    assert manifest.platform == prebuilt.Platform.current()
    assert sorted(manifest.libraries) == sorted(LIBRARIES)
    for name, entry in manifest.libraries.items():
        assert (artefacts / entry.file).is_file(), name


def test_fresh_env_runs_the_prebuilt_kernels_natively(work: Path, build_env: dict[str, str],
                                                      fresh_python: str, installed: Path) -> None:
    reference = _probe(sys.executable, build_env, work / "probe-build")
    fresh = _probe(fresh_python, _fresh_env(fresh_python, installed, work / "cache-fresh"),
                   work / "probe-fresh")
    # Nothing could have been compiled there.
    assert fresh.doc["tools"] == dict.fromkeys(fresh.doc["tools"])
    assert fresh.doc["ninja"] is False
    for name in ("mxfp4", "dense"):
        lib, ref = fresh.library(name), reference.library(name)
        assert ref["state"] == "ready" and not ref["prebuilt"], ref
        assert lib["state"] == "ready" and lib["prebuilt"], lib
        assert Path(lib["library"]).parent == installed
        # Every tier the compiler-equipped build runs here, the prebuilt one runs too.
        assert (lib["active"], lib["available"]) == (ref["active"], ref["available"])
        assert fresh.doc["default_backend"][name] == reference.doc["default_backend"][name]
        # The same machine code on the same inputs: bit-identical to the JIT build's output,
        # and close to the plain-torch reference.
        assert torch.equal(fresh.outputs[name], reference.outputs[name])
        torch.testing.assert_close(fresh.outputs[name], fresh.outputs[f"{name}_reference"],
                                   rtol=1e-4, atol=1e-3)
    assert fresh.doc["default_backend"]["mxfp4"] != "reference"  # a native call ran
    assert "not used" not in fresh.stderr


def _doctor(fresh_python: str, env: dict[str, str]) -> str:
    out = _run([fresh_python, "-m", "services.cli", "doctor"], env).stdout
    rows = [line for line in out.splitlines() if line.startswith("prebuilt ")]
    assert len(rows) == 1, out
    return out


def test_doctor_reports_the_prebuilt_kernels(work: Path, fresh_python: str,
                                             installed: Path) -> None:
    out = _doctor(fresh_python, _fresh_env(fresh_python, installed, work / "cache-doctor"))
    row = next(line for line in out.splitlines() if line.startswith("prebuilt "))
    for name in LIBRARIES:
        assert f"{name} loaded from {installed / name}" in row, out
    assert "build failed" not in out and out.count("(prebuilt)") == 2, out


def test_stale_prebuilt_is_refused_and_falls_back(work: Path, fresh_python: str,
                                                  installed: Path) -> None:
    """Sources changed since the build: that library is refused (no compiler to rebuild it
    here, so it runs the reference); the other one still loads."""
    stale = work / "kernels-stale"
    shutil.copytree(installed, stale)
    path = stale / prebuilt.MANIFEST
    doc = json.loads(path.read_text())
    doc["libraries"]["pdmesh_dense"]["source_digest"] = "0" * 64
    path.write_text(json.dumps(doc))
    env = _fresh_env(fresh_python, stale, work / "cache-stale")
    proc = _run([fresh_python, "-m", "services.cli", "doctor"], env)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("prebuilt "))
    assert "pdmesh_dense refused (stale" in row and "reference instead" in row, proc.stdout
    assert f"pdmesh_mxfp4 loaded from {stale / 'pdmesh_mxfp4'}" in row, proc.stdout
    assert "prebuilt pdmesh_dense" in proc.stderr and "not used (stale" in proc.stderr
    dense_row = next(line for line in proc.stdout.splitlines() if line.startswith("dense"))
    assert "active=reference" in dense_row and "no C++ compiler" in dense_row, dense_row


ENGINE_PROBE = """
from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from kernels.dense import build
LLMEngine.from_config(EngineConfig(model={model!r}, dtype="bfloat16", num_threads=1))
result = build.peek()
print("dense", result.state, "prebuilt" if result.prebuilt else "not-prebuilt", result.error)
"""


def test_a_bf16_engine_uses_the_prebuilt_dense_library(work: Path, fresh_python: str,
                                                        installed: Path,
                                                        make_checkpoint) -> None:  # noqa: ANN001
    model = make_checkpoint(preset="tiny")
    env = _fresh_env(fresh_python, installed, work / "cache-engine")
    out = _run([fresh_python, "-c", ENGINE_PROBE.format(model=str(model))], env).stdout
    assert "dense ready prebuilt" in out, out
