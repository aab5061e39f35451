"""The scaffold every native library of kernels/ shares: its build, its load, and which of its
backends runs.

A library (kernels.dense, kernels.mxfp4) declares a `Recipe` (namespace, sources, flags) and a
Backend enum whose members sit on kernels.tier's ladder. This module compiles the recipe with
torch.utils.cpp_extension.load at first use, into a directory keyed by the torch and Python
versions (ninja recompiles only what changed), or first loads a prebuilt copy when the
BuildConfig names one (kernels/prebuilt.py). The ops register under torch.ops.<namespace>; no
pybind. A failed build is recorded, not raised: callers run the reference and a RuntimeWarning
says why.

Every library's C++ includes csrc/native.h and answers `features()` with the same bits, so one
`Library` reads what this CPU and the build can run, and one `Dispatch` resolves a backend name,
or None (the fastest backend within kernels.tier's cap), the same way for every library.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from kernels import prebuilt, tier
from kernels.tier import Tier

SHARED_CSRC = Path(__file__).parent / "csrc"  # native.h, included by every library

# features() bits (csrc/native.h).
_HAS_AVX512_CODE = 1
_CPU_AVX512 = 2
_CPU_BF16 = 4
_HAS_AVX2_CODE = 8
_CPU_AVX2 = 16
_CPU_FMA = 32
_CPU_F16C = 64


# The `path` argument of every library's C++ ops, by tier (csrc/native.h's kPath*): one number
# names a tier in every library. The reference (plain torch) has none.
PATH_IDS = {Tier.PORTABLE: 0, Tier.AVX512: 1, Tier.AVX2: 2, Tier.AVX512_BF16: 3}


def path_id(rung: Tier) -> int:
    """The C++ ops' `path` for a tier; ValueError for the reference, which has no C++ path."""
    if rung not in PATH_IDS:
        raise ValueError(f"the {rung.label} tier has no C++ code path")
    return PATH_IDS[rung]


class BuildState(StrEnum):
    NOT_BUILT = "not_built"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class BuildConfig:
    """Where to build: build_root holds one directory per torch/Python version; prebuilt_dir,
    when set, is a `pdmesh kernels build` output tried before building."""

    build_root: Path
    verbose: bool = False
    prebuilt_dir: Path | None = None

    @classmethod
    def from_env(cls) -> BuildConfig:
        """TORCH_EXTENSIONS_DIR if set, else <PDMESH_CACHE or ~/.cache/pdmesh>/torch_extensions;
        prebuilt libraries from PDMESH_KERNELS_DIR when it is set.

        The only place the kernels read the environment; engines pass their own config instead.
        """
        kernels_dir = os.environ.get("PDMESH_KERNELS_DIR")
        torch_dir = os.environ.get("TORCH_EXTENSIONS_DIR")
        cache = os.environ.get("PDMESH_CACHE") or Path.home() / ".cache" / "pdmesh"
        root = Path(torch_dir) if torch_dir else Path(cache) / "torch_extensions"
        return cls(build_root=root, prebuilt_dir=Path(kernels_dir) if kernels_dir else None)

    def build_dir(self, namespace: str) -> Path:
        tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
        return self.build_root / tag / namespace


@dataclass(frozen=True)
class Recipe:
    """How to build one library: its torch.ops namespace (also the extension's name), its
    sources under csrc, extra compiler flags, the build recipe file (the library's build.py)
    and a variant name; all of them enter the prebuilt source digest."""

    namespace: str
    csrc: Path
    sources: tuple[str, ...]
    recipe_file: Path
    cflags: tuple[str, ...] = ()
    variant: str = ""
    fallback: str = "the plain-torch reference"  # what runs when the build fails (warnings)

    def source_digest(self) -> str:
        """What a prebuilt library must have been built from (kernels/prebuilt.py)."""
        return prebuilt.source_digest(self.csrc, self.recipe_file, self.variant,
                                      extra=(SHARED_CSRC / "native.h", Path(__file__)))


@dataclass(frozen=True)
class Library:
    """A loaded library: its ops namespace and what it (and this CPU) can run."""

    namespace: str
    path: Path
    features: int

    @property
    def ops(self) -> Any:
        return getattr(torch.ops, self.namespace)

    def _has(self, *bits: int) -> bool:
        return all(self.features & bit for bit in bits)

    @property
    def has_avx512_code(self) -> bool:
        return self._has(_HAS_AVX512_CODE)

    @property
    def has_avx2_code(self) -> bool:
        return self._has(_HAS_AVX2_CODE)

    @property
    def cpu_avx2(self) -> bool:
        """The CPU has avx2, fma and f16c (the AVX2 tier), whether or not the code is compiled in."""
        return self._has(_CPU_AVX2, _CPU_FMA, _CPU_F16C)

    @property
    def cpu_avx512(self) -> bool:
        """The CPU has avx512f/bw/vl/dq, whether or not the code is compiled in."""
        return self._has(_CPU_AVX512)

    @property
    def cpu_bf16(self) -> bool:
        """The CPU has avx512_bf16 as well: bf16 x can use vdpbf16ps."""
        return self._has(_CPU_AVX512, _CPU_BF16)

    def missing_avx2_features(self) -> list[str]:
        """The AVX2 tier's CPU features this CPU lacks (empty when it has them all)."""
        named = (("avx2", _CPU_AVX2), ("fma", _CPU_FMA), ("f16c", _CPU_F16C))
        return [name for name, bit in named if not self._has(bit)]

    def cpu_tier(self) -> Tier:
        """The highest tier this CPU can execute, by its features."""
        if self.cpu_bf16:
            return Tier.AVX512_BF16
        if self.cpu_avx512:
            return Tier.AVX512
        return Tier.AVX2 if self.cpu_avx2 else Tier.PORTABLE


@dataclass(frozen=True)
class BuildResult:
    """Outcome of one load; library is None unless state is READY."""

    config: BuildConfig
    recipe: Recipe
    state: BuildState
    library: Library | None = None
    seconds: float = 0.0  # wall time of the load (compile included when it compiled)
    compiled: bool = False  # the .so was (re)built by this load
    error: str | None = None
    prebuilt: bool = False  # loaded from config.prebuilt_dir
    prebuilt_refused: str | None = None  # why config.prebuilt_dir's library was not used

    @property
    def build_dir(self) -> Path:
        """Where the library is (a prebuilt's directory) or would be built."""
        if self.prebuilt and self.library is not None:
            return self.library.path.parent
        return self.config.build_dir(self.recipe.namespace)


_results: dict[str, BuildResult] = {}  # by namespace: a torch.ops namespace registers once
_lock = threading.Lock()


def peek(namespace: str) -> BuildResult | None:
    """The result of an earlier load() of this namespace in this process, without building."""
    return _results.get(namespace)


def load(recipe: Recipe, config: BuildConfig) -> BuildResult:
    """Build (if needed) and load the recipe's library, once per process and namespace (the
    first config wins); never raises for build errors."""
    with _lock:
        result = _results.get(recipe.namespace)
        if result is None:
            result = _results[recipe.namespace] = build(recipe, config)
            if result.state is BuildState.FAILED:
                warnings.warn(f"{recipe.namespace} C++ kernels unavailable ({result.error}); "
                              f"falling back to {recipe.fallback}", RuntimeWarning, stacklevel=3)
        return result


def build(recipe: Recipe, config: BuildConfig) -> BuildResult:
    """The prebuilt library when config names one that fits, else the JIT build."""
    if config.prebuilt_dir is None:
        return jit_build(recipe, config)
    got = prebuilt.attempt(config.prebuilt_dir, recipe.namespace, recipe.source_digest())
    if got.path is None:
        return replace(jit_build(recipe, config), prebuilt_refused=got.refused)
    library = Library(recipe.namespace, got.path, got.features)
    return BuildResult(config, recipe, BuildState.READY, library=library, seconds=got.seconds,
                       prebuilt=True)


def jit_build(recipe: Recipe, config: BuildConfig) -> BuildResult:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    start_ns = time.time_ns()
    missing = missing_tool()
    if missing:
        return BuildResult(config, recipe, BuildState.FAILED, error=missing)
    build_dir = config.build_dir(recipe.namespace)
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        path = cpp_extension.load(
            name=recipe.namespace,
            sources=[str(recipe.csrc / name) for name in recipe.sources],
            # -fopenmp: at::parallel_for's OpenMP region
            extra_cflags=["-O3", "-fopenmp", *recipe.cflags],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(SHARED_CSRC)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=config.verbose,
        )
        features = int(getattr(torch.ops, recipe.namespace).features())
    except Exception as exc:  # compiler/linker errors, a broken toolchain, an unwritable cache
        return BuildResult(config, recipe, BuildState.FAILED,
                           seconds=time.perf_counter() - start, error=summarise(exc))
    return BuildResult(
        config, recipe, BuildState.READY,
        library=Library(recipe.namespace, Path(path), features),
        seconds=time.perf_counter() - start,
        compiled=Path(path).stat().st_mtime_ns >= start_ns,
    )


def missing_tool() -> str | None:
    """Why no library can be compiled here (no compiler, no ninja), or None."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def summarise(exc: Exception) -> str:
    """The first compiler 'error:' line of a failed build (BuildConfig(verbose=True) shows all)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    detail = errors[0] if errors else (lines[-1] if lines else "")
    return f"{type(exc).__name__}: {detail[:500]}"


class TieredBackend(Protocol):
    """What a library's Backend enum provides: its rung on the ladder."""

    @property
    def tier(self) -> Tier: ...


B = TypeVar("B", bound=TieredBackend)


def runnable(backend: TieredBackend, lib: Library | None) -> bool:
    """Whether this process runs `backend` with this library (None: not loaded)."""
    rung = backend.tier
    if rung is Tier.REFERENCE:
        return True
    if lib is None:
        return False
    return {
        Tier.PORTABLE: True,
        Tier.AVX2: lib.has_avx2_code and lib.cpu_avx2,
        Tier.AVX512: lib.has_avx512_code and lib.cpu_avx512,
        Tier.AVX512_BF16: lib.has_avx512_code and lib.cpu_bf16,
    }[rung]


def runnable_backends(backends: Iterable[B], build: BuildResult) -> tuple[B, ...]:
    """Those of `backends` this process can run with this build, in the order given."""
    return tuple(b for b in backends if runnable(b, build.library))


def unavailable_reason(backend: TieredBackend, build: BuildResult) -> str:
    """Why `runnable(backend, build.library)` is False."""
    lib, rung, name = build.library, backend.tier, str(backend)
    if lib is None:
        return f"the C++ library did not build ({build.error or build.state})"
    variant = build.recipe.variant or "library's"
    if rung is Tier.AVX2 and not lib.has_avx2_code:
        return f"the {variant} build contains no AVX2 code"
    if rung >= Tier.AVX512 and not lib.has_avx512_code:
        return f"the {variant} build contains no AVX-512 code"
    if rung is Tier.AVX2 and not lib.cpu_avx2:
        return f"this CPU cannot run the avx2 tier: it lacks {'/'.join(lib.missing_avx2_features())}"
    if rung >= Tier.AVX512 and not lib.cpu_avx512:
        return f"this CPU cannot run the {name} tier: it lacks avx512f/avx512bw/avx512vl/avx512dq"
    if rung is Tier.AVX512_BF16 and not lib.cpu_bf16:
        return "this CPU cannot run the avx512_bf16 tier: it lacks avx512_bf16"
    return f"{name} is runnable"


@dataclass(frozen=True)
class NativePath(Generic[B]):
    """One runnable backend of a library, the object its callers hold: the backend and the
    loaded library, which is None exactly when the backend is the plain-torch reference.
    Each library subclasses it with its operations."""

    backend: B
    library: Library | None = None

    def __post_init__(self) -> None:
        if (self.library is None) != (self.backend.tier is Tier.REFERENCE):
            raise ValueError(f"backend {self.backend} needs library iff it is compiled")


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (not built, compiled out, or missing CPU features)."""


P = TypeVar("P")


@dataclass
class Dispatch(Generic[B, P]):
    """One library's process-wide state: its BuildConfig (from the environment unless
    configure()d first), and the kernel path each backend argument resolves to.

    None resolves to the fastest runnable backend whose tier is at most kernels.tier.max_tier()
    (again after the cap changes); an explicit backend name is not capped, and one this process
    cannot run raises BackendUnavailableError saying why.
    """

    name: str  # "dense", "mxfp4": error messages
    backends: tuple[B, ...]  # every backend, fastest first; the last is the reference
    recipe_of: Callable[[Any], Recipe]  # the library's BuildConfig -> what to build
    default_config: Callable[[], Any]
    make_path: Callable[[B, Library | None], P]
    parse: Callable[[str], B]
    _config: Any = None
    _paths: dict[object, P] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        tier.on_cap_change(self._forget_paths)

    def _forget_paths(self) -> None:
        with self._lock:
            self._paths.clear()

    def configure(self, config: Any) -> None:
        """Choose where (and what) to build; call before the first kernel use (the first build
        of a namespace wins)."""
        with self._lock:
            self._config = config
            self._paths.clear()

    def config(self) -> Any:
        with self._lock:
            if self._config is None:
                self._config = self.default_config()
            return self._config

    def build(self) -> BuildResult:
        config = self.config()
        return load(self.recipe_of(config), config)

    def peek(self) -> BuildResult | None:
        """The current config's load result, without building."""
        return peek(self.recipe_of(self.config()).namespace)

    def runnable(self, build: BuildResult) -> tuple[B, ...]:
        """Backends this process can run with this build, fastest first (uncapped)."""
        return runnable_backends(self.backends, build)

    def active(self, build: BuildResult) -> B:
        """The backend None picks: the fastest runnable one within the tier cap."""
        cap = tier.max_tier()
        return next(b for b in self.runnable(build) if b.tier <= cap)  # the reference always runs

    def path(self, backend: str | B | None = None) -> P:
        """The kernel path `backend` resolves to; callers on a hot path can keep it."""
        key: object = backend
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = self._resolve(backend)
        return path

    def _resolve(self, backend: str | B | None) -> P:
        build = self.build()
        if backend is None:
            chosen = self.active(build)
        else:
            try:
                chosen = self.parse(str(backend))
            except ValueError:
                names = ", ".join(repr(str(b)) for b in self.backends)
                raise ValueError(f"{self.name}: unknown backend {backend!r}; expected None or "
                                 f"one of {names}") from None
            if chosen not in self.runnable(build):
                raise BackendUnavailableError(
                    f"{self.name}: backend {str(chosen)!r} is unavailable: "
                    f"{unavailable_reason(chosen, build)}")
        return self.make_path(chosen, None if chosen.tier is Tier.REFERENCE else build.library)

    def info(self, build: bool = True) -> BuildInfo:
        """Build state and active backend; build=False reports without compiling anything."""
        config = self.config()
        recipe = self.recipe_of(config)
        result = self.build() if build else peek(recipe.namespace)
        if result is None:
            result = BuildResult(config, recipe, BuildState.NOT_BUILT)
        lib = result.library
        return BuildInfo(
            variant=recipe.variant,
            state=str(result.state),
            build_dir=str(result.build_dir),
            library=None if lib is None else str(lib.path),
            seconds=round(result.seconds, 3),
            compiled=result.compiled,
            error=result.error,
            cpu_avx2=None if lib is None else lib.cpu_avx2,
            cpu_avx512=None if lib is None else lib.cpu_avx512,
            cpu_avx512_bf16=None if lib is None else lib.cpu_bf16,
            cpu_tier=None if lib is None else lib.cpu_tier().label,
            max_tier=tier.max_tier().label,
            available=tuple(str(b) for b in self.runnable(result)),
            active=str(self.active(result)),
            prebuilt=result.prebuilt,
        )


@dataclass(frozen=True)
class BuildInfo:
    """What `pdmesh doctor` shows of one library: the build's state, the CPU's tier, the cap and
    which backend None picks (`active`)."""

    variant: str  # "" for a library with one variant
    state: str
    build_dir: str
    library: str | None
    seconds: float
    compiled: bool
    error: str | None
    cpu_avx2: bool | None  # avx2 + fma + f16c; None: unknown (the library is not loaded)
    cpu_avx512: bool | None
    cpu_avx512_bf16: bool | None
    cpu_tier: str | None  # the highest tier this CPU executes (None: unknown)
    max_tier: str  # the cap on backend=None (kernels.tier.max_tier())
    available: tuple[str, ...]  # runnable here, fastest first, uncapped
    active: str
    prebuilt: bool = False  # loaded from BuildConfig.prebuilt_dir (`pdmesh kernels build`)

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)

    def __str__(self) -> str:
        what = f"{self.variant} build" if self.variant else "build"
        if self.state == BuildState.READY:
            how = ("prebuilt" if self.prebuilt else f"compiled in {self.seconds:.1f} s"
                   if self.compiled else "loaded from cache")
            built = f"{what} ready ({how}) in {self.build_dir}"
        elif self.state == BuildState.FAILED:
            built = f"{what} failed: {self.error}"
        else:
            built = f"{what} not attempted"
        flags = {True: "yes", False: "no", None: "unknown"}
        cpu = (f"cpu tier {self.cpu_tier or 'unknown'} (avx2={flags[self.cpu_avx2]} "
               f"avx512={flags[self.cpu_avx512]} avx512_bf16={flags[self.cpu_avx512_bf16]})")
        return (f"active={self.active} (cap {self.max_tier}; available: "
                f"{', '.join(self.available)}); {built}; {cpu}")
