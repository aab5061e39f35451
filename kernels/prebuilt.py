"""Prebuilt native kernels: a directory of compiled libraries and the manifest vouching for them.

`pdmesh kernels build --out DIR` compiles every library (kernels.dense, kernels.mxfp4) ahead of
time and writes them here; a runtime with no compiler (the Docker image's runtime stage) loads
them with `torch.ops.load_library` when its BuildConfig names the directory (PDMESH_KERNELS_DIR).

    DIR/manifest.json      {"format": 1, "torch": ..., "python": "3.11", "machine": "x86_64",
                            "libraries": {namespace: {"file", "source_digest", "sha256"}}}
    DIR/<namespace>.so     one file per library, every tier's code inside (run-time dispatch)

A library is used only when everything that decides its binary matches this process: the torch
version (the C++ ABI of libtorch), Python's major.minor, the machine, and the source digest
(every C++ source and header of the library plus its build recipe, build.py, where the source
list and compiler flags live). Anything else is refused with the reason (`PrebuiltRefused`),
and the caller falls back to the JIT build or the reference, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

MANIFEST = "manifest.json"
FORMAT = 1
# Suffixes of the files whose contents make up a library's source digest (pyproject ships them).
SOURCE_SUFFIXES = (".cpp", ".cc", ".h", ".hpp")


class PrebuiltRefused(RuntimeError):
    """A prebuilt library that cannot be used here; the message says why."""


@dataclass(frozen=True)
class LibraryEntry:
    """One library in the manifest: its file, the digest of what it was built from, its bytes."""

    file: str
    source_digest: str
    sha256: str


@dataclass(frozen=True)
class Platform:
    """What a binary's compatibility with this process depends on, besides its sources."""

    torch: str
    python: str  # major.minor
    machine: str

    @classmethod
    def current(cls) -> Platform:
        return cls(torch=str(torch.__version__),
                   python=f"{sys.version_info.major}.{sys.version_info.minor}",
                   machine=platform.machine().lower())


@dataclass(frozen=True)
class Manifest:
    """The contents of manifest.json."""

    platform: Platform
    libraries: Mapping[str, LibraryEntry] = field(default_factory=dict)
    format: int = FORMAT

    def to_json(self) -> str:
        doc = {"format": self.format, **asdict(self.platform),
               "libraries": {name: asdict(e) for name, e in sorted(self.libraries.items())}}
        return json.dumps(doc, indent=2) + "\n"

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """Raises PrebuiltRefused for a missing or malformed manifest."""
        path = directory / MANIFEST
        try:
            doc = json.loads(path.read_text())
            if doc["format"] != FORMAT:
                raise PrebuiltRefused(f"{path}: manifest format {doc['format']!r}, "
                                      f"this pdmesh reads {FORMAT}")
            libraries = {str(name): LibraryEntry(**entry)
                         for name, entry in doc["libraries"].items()}
            return cls(Platform(str(doc["torch"]), str(doc["python"]), str(doc["machine"])),
                       libraries, FORMAT)
        except FileNotFoundError:
            raise PrebuiltRefused(f"no {MANIFEST} in {directory}") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PrebuiltRefused(f"{path} is unreadable: {type(exc).__name__}: {exc}") from None


def source_digest(csrc: Path, recipe: Path, variant: str = "",
                  extra: tuple[Path, ...] = ()) -> str:
    """sha256 over every C++ source and header under `csrc` (name and contents, name order),
    the `extra` headers it includes from elsewhere (kernels/csrc/native.h), the recipe file
    (the library's build.py: source list and flags) and the variant's name.

    Paths enter as relative names, so a source tree and an installed package agree.
    """
    h = hashlib.sha256()
    files = sorted(p for p in csrc.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)
    named = [(p.relative_to(csrc.parent).as_posix(), p) for p in [*files, recipe]]
    named += [(f"shared/{p.name}", p) for p in extra]
    for name, path in named:
        data = path.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode() + data)
    h.update(variant.encode())
    return h.hexdigest()


def find(directory: Path, namespace: str, digest: str) -> Path:
    """The prebuilt file of `namespace` in `directory`, checked against this process and the
    installed sources; raises PrebuiltRefused naming the first mismatch."""
    manifest = Manifest.read(directory)
    here = Platform.current()
    for name in ("torch", "python", "machine"):
        built, ours = getattr(manifest.platform, name), getattr(here, name)
        if built != ours:
            raise PrebuiltRefused(f"built for {name} {built}, this process has {ours}")
    entry = manifest.libraries.get(namespace)
    if entry is None:
        raise PrebuiltRefused(f"{namespace} is not in {directory / MANIFEST} "
                              f"(it has: {', '.join(sorted(manifest.libraries)) or 'nothing'})")
    if entry.source_digest != digest:
        raise PrebuiltRefused(f"stale: built from other sources (source digest "
                              f"{entry.source_digest[:12]}, the installed sources are "
                              f"{digest[:12]})")
    path = directory / entry.file
    if Path(entry.file).name != entry.file or not path.is_file():
        raise PrebuiltRefused(f"{path} is missing")
    if _sha256(path) != entry.sha256:
        raise PrebuiltRefused(f"{path} does not match its manifest checksum (corrupt copy?)")
    return path


@dataclass(frozen=True)
class Attempt:
    """The outcome of trying a prebuilt library: loaded (path, features) or refused (why)."""

    path: Path | None = None
    features: int = 0  # the library's features() bits (what this CPU can run of it)
    seconds: float = 0.0
    refused: str | None = None


def attempt(directory: Path, namespace: str, digest: str) -> Attempt:
    """find() the library, load it into torch.ops (no compiler, no ninja) and ask its
    features() op. On any failure a RuntimeWarning names the reason and `refused` holds it.

    Only a features() op that raises leaves the namespace registered (a broken build of the
    library; the JIT fallback then fails too and the caller runs the reference).
    """
    start = time.perf_counter()
    try:
        path = find(directory, namespace, digest)
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as exc:  # the dynamic loader: a missing libgomp...
            raise PrebuiltRefused(f"{path} does not load: {exc}") from None
        features = int(getattr(torch.ops, namespace).features())
    except Exception as exc:  # PrebuiltRefused, or a features() op that fails
        reason = str(exc) if isinstance(exc, PrebuiltRefused) else f"{type(exc).__name__}: {exc}"
        warnings.warn(f"prebuilt {namespace} in {directory} not used ({reason[:500]}); "
                      "building it instead", RuntimeWarning, stacklevel=5)
        return Attempt(refused=reason)
    return Attempt(path, features, time.perf_counter() - start)


def write(out: Path, libraries: Mapping[str, tuple[Path, str]]) -> Manifest:
    """Copy each built library (namespace -> (path, source digest)) into `out` and write the
    manifest last, atomically, so a reader never sees a manifest naming a half-copied file."""
    out.mkdir(parents=True, exist_ok=True)
    entries: dict[str, LibraryEntry] = {}
    for namespace, (built, digest) in libraries.items():
        target = out / f"{namespace}{built.suffix}"
        shutil.copyfile(built, target)
        entries[namespace] = LibraryEntry(target.name, digest, _sha256(target))
    manifest = Manifest(Platform.current(), entries)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".manifest-")
    with os.fdopen(fd, "w") as f:
        f.write(manifest.to_json())
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from the image's unprivileged user
    os.replace(tmp, out / MANIFEST)
    return manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()
