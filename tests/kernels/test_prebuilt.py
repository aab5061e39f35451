"""Prebuilt kernels (kernels/prebuilt.py): the manifest, the source digest, and every refusal.

Nothing here loads a library (a torch.ops namespace registers once per process); loading a
prebuilt library with no compiler on PATH is test_prebuilt_venv.py's job.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import pytest

from kernels import _native, prebuilt
from kernels.dense import build as dense_build
from kernels.mxfp4 import build as mxfp4_build
from kernels.prebuilt import Manifest, Platform, PrebuiltRefused


@pytest.fixture
def prebuilt_dir(tmp_path: Path) -> Path:
    """A directory written by prebuilt.write from two stand-in library files."""
    built = tmp_path / "built"
    built.mkdir()
    libs = {}
    for name in ("pdmesh_a", "pdmesh_b"):
        (built / f"{name}.so").write_bytes(name.encode() * 100)
        libs[name] = (built / f"{name}.so", f"{name}-digest")
    out = tmp_path / "out"
    prebuilt.write(out, libs)
    return out


def _edit_manifest(directory: Path, edit) -> None:  # noqa: ANN001 - a dict -> None callable
    path = directory / prebuilt.MANIFEST
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def test_written_libraries_are_found(prebuilt_dir: Path) -> None:
    manifest = Manifest.read(prebuilt_dir)
    assert manifest.platform == Platform.current()
    assert sorted(manifest.libraries) == ["pdmesh_a", "pdmesh_b"]
    path = prebuilt.find(prebuilt_dir, "pdmesh_a", "pdmesh_a-digest")
    assert path == prebuilt_dir / "pdmesh_a.so"
    assert path.read_bytes() == b"pdmesh_a" * 100  # a copy of what was built
    assert oct((prebuilt_dir / prebuilt.MANIFEST).stat().st_mode & 0o777) == "0o644"


REFUSALS = {
    "stale sources": (lambda d: None, "pdmesh_a", "other-digest", "stale"),
    "other torch": (lambda d: _edit_manifest(d, lambda m: m.update(torch="1.0.0")),
                    "pdmesh_a", "pdmesh_a-digest", "built for torch 1.0.0"),
    "other python": (lambda d: _edit_manifest(d, lambda m: m.update(python="3.99")),
                     "pdmesh_a", "pdmesh_a-digest", "built for python 3.99"),
    "other machine": (lambda d: _edit_manifest(d, lambda m: m.update(machine="riscv64")),
                      "pdmesh_a", "pdmesh_a-digest", "built for machine riscv64"),
    "not in the manifest": (lambda d: None, "pdmesh_c", "x", "pdmesh_c is not in"),
    "file missing": (lambda d: (d / "pdmesh_a.so").unlink(), "pdmesh_a", "pdmesh_a-digest",
                     "missing"),
    "file corrupt": (lambda d: (d / "pdmesh_a.so").write_bytes(b"x"), "pdmesh_a",
                     "pdmesh_a-digest", "checksum"),
    "file outside the directory": (
        lambda d: _edit_manifest(d, lambda m: m["libraries"]["pdmesh_a"].update(
            file="../built/pdmesh_a.so")), "pdmesh_a", "pdmesh_a-digest", "missing"),
    "no manifest": (lambda d: (d / prebuilt.MANIFEST).unlink(), "pdmesh_a", "pdmesh_a-digest",
                    "no manifest.json"),
    "malformed manifest": (lambda d: (d / prebuilt.MANIFEST).write_text("{"), "pdmesh_a",
                           "pdmesh_a-digest", "unreadable"),
    "other format": (lambda d: _edit_manifest(d, lambda m: m.update(format=99)), "pdmesh_a",
                     "pdmesh_a-digest", "format 99"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_mismatches_are_refused_with_the_reason(prebuilt_dir: Path, case: str) -> None:
    damage, namespace, digest, words = REFUSALS[case]
    damage(prebuilt_dir)
    with pytest.raises(PrebuiltRefused, match=words):
        prebuilt.find(prebuilt_dir, namespace, digest)
    with pytest.warns(RuntimeWarning, match=f"prebuilt {namespace} .* not used"):
        got = prebuilt.attempt(prebuilt_dir, namespace, digest)
    assert got.path is None and words.split()[0] in (got.refused or "")


def _copy_sources(src: Path, dst: Path) -> tuple[Path, Path]:
    shutil.copytree(src / "csrc", dst / "csrc")
    shutil.copyfile(src / "build.py", dst / "build.py")
    return dst / "csrc", dst / "build.py"


def test_source_digest_sees_sources_headers_and_recipe(tmp_path: Path) -> None:
    library = Path(mxfp4_build.__file__).parent
    csrc, recipe = _copy_sources(library, tmp_path / "copy")
    # The same files elsewhere (a source tree and an installed package) digest the same.
    assert prebuilt.source_digest(csrc, recipe) == prebuilt.source_digest(
        library / "csrc", library / "build.py")
    base = prebuilt.source_digest(csrc, recipe)
    assert prebuilt.source_digest(csrc, recipe, "scalar_only") != base
    for changed in (csrc / "ops.cpp", csrc / "kernels.h", recipe):
        original = changed.read_bytes()
        changed.write_bytes(original + b"\n")
        assert prebuilt.source_digest(csrc, recipe) != base, changed.name
        changed.write_bytes(original)
    (csrc / "new_tier.cpp").write_text("// a source added later\n")
    assert prebuilt.source_digest(csrc, recipe) != base
    (csrc / "new_tier.cpp").unlink()
    (csrc / "notes.txt").write_text("not a source")  # not shipped, not digested
    assert prebuilt.source_digest(csrc, recipe) == base


def test_each_library_and_variant_has_its_own_digest(tmp_path: Path) -> None:
    full = mxfp4_build.BuildConfig(tmp_path, variant=mxfp4_build.Variant.FULL)
    scalar = dataclasses.replace(full, variant=mxfp4_build.Variant.SCALAR_ONLY)
    digests = {mxfp4_build.source_digest(full), mxfp4_build.source_digest(scalar),
               dense_build.source_digest()}
    assert len(digests) == 3


def test_the_shared_header_is_in_every_digest(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/csrc/native.h is compiled into both libraries: editing it makes both stale."""
    config = mxfp4_build.BuildConfig(tmp_path)
    before = (mxfp4_build.source_digest(config), dense_build.source_digest())
    header = tmp_path / "csrc" / "native.h"
    header.parent.mkdir()
    header.write_bytes((_native.SHARED_CSRC / "native.h").read_bytes() + b"\n")
    monkeypatch.setattr(_native, "SHARED_CSRC", header.parent)
    after = (mxfp4_build.source_digest(config), dense_build.source_digest())
    assert after[0] != before[0] and after[1] != before[1]


def test_from_env_reads_the_prebuilt_directory(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("PDMESH_KERNELS_DIR", str(tmp_path))
    assert mxfp4_build.BuildConfig.from_env().prebuilt_dir == tmp_path
    assert dense_build.BuildConfig.from_env().prebuilt_dir == tmp_path
    monkeypatch.delenv("PDMESH_KERNELS_DIR")
    assert mxfp4_build.BuildConfig.from_env().prebuilt_dir is None
    assert dense_build.BuildConfig.from_env().prebuilt_dir is None


@pytest.mark.parametrize("library", ["mxfp4", "dense"])
def test_a_refused_prebuilt_falls_back_to_the_jit_build(library: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's fallback, without loading anything: the JIT build is a stand-in."""
    config: _native.BuildConfig
    if library == "mxfp4":
        config = mxfp4_build.BuildConfig(build_root=tmp_path / "jit",
                                         prebuilt_dir=tmp_path / "empty")
        recipe = mxfp4_build.recipe(config)
    else:
        config = dense_build.BuildConfig(build_root=tmp_path / "jit",
                                         prebuilt_dir=tmp_path / "empty")
        recipe = dense_build.RECIPE
    jit = _native.BuildResult(config, recipe, _native.BuildState.FAILED, error="stand-in JIT build")
    monkeypatch.setattr(_native, "jit_build", lambda _recipe, _config: jit)
    with pytest.warns(RuntimeWarning, match="no manifest.json"):
        result = _native.build(recipe, config)
    assert result == dataclasses.replace(jit, prebuilt_refused=result.prebuilt_refused)
    assert "no manifest.json" in (result.prebuilt_refused or "") and not result.prebuilt
    without = dataclasses.replace(config, prebuilt_dir=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no prebuilt configured: nothing to warn about
        assert _native.build(recipe, without) is jit
