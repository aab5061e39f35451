"""`pdmesh kernels build --out DIR`: compile the native kernels ahead of time.

Builds both C++ libraries (kernels.mxfp4, kernels.dense; every tier's code in one file, chosen
at run time) with the JIT recipe, then copies them into DIR with a manifest (kernels/prebuilt.py).
A process whose PDMESH_KERNELS_DIR names DIR loads them with no compiler present: the Docker
image's build stage runs this, its runtime stage only copies DIR.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

HELP = "Build the native kernels into a directory (for runtimes without a compiler)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    build = sub.add_parser("build", help="compile both libraries and write DIR/manifest.json")
    build.add_argument("--out", type=Path, required=True, help="output directory (created)")
    build.add_argument("--build-root", type=Path, default=None,
                       help="where to compile (default: the JIT cache, TORCH_EXTENSIONS_DIR or "
                            "$PDMESH_CACHE/torch_extensions, so unchanged sources are reused)")
    build.add_argument("--verbose", action="store_true", help="show the compiler's output")


def run(args: argparse.Namespace) -> int:
    from kernels import prebuilt
    from kernels.dense import build as dense_build
    from kernels.mxfp4 import build as mxfp4_build

    # Never from an existing prebuilt directory: this is what produces one.
    mxfp4_cfg = replace(mxfp4_build.BuildConfig.from_env(), prebuilt_dir=None,
                        verbose=args.verbose)
    dense_cfg = replace(dense_build.BuildConfig.from_env(), prebuilt_dir=None,
                        verbose=args.verbose)
    if args.build_root is not None:
        mxfp4_cfg = replace(mxfp4_cfg, build_root=args.build_root)
        dense_cfg = replace(dense_cfg, build_root=args.build_root)
    libraries = (
        (mxfp4_cfg.namespace, mxfp4_build.load(mxfp4_cfg), mxfp4_build.source_digest(mxfp4_cfg)),
        (dense_build.NAMESPACE, dense_build.load(dense_cfg), dense_build.source_digest()),
    )
    built: dict[str, tuple[Path, str]] = {}
    for namespace, result, digest in libraries:
        if result.library is None:
            print(f"kernels build: {namespace} did not build: {result.error}", file=sys.stderr)
            return 1
        how = f"compiled in {result.seconds:.1f} s" if result.compiled else "unchanged"
        print(f"{namespace:<14} {result.library.path} ({how})")
        built[namespace] = (result.library.path, digest)
    manifest = prebuilt.write(args.out, built)
    platform = manifest.platform
    print(f"wrote {args.out / prebuilt.MANIFEST}: torch {platform.torch}, python "
          f"{platform.python}, {platform.machine}; "
          + ", ".join(f"{e.file} (sources {e.source_digest[:12]})"
                      for e in manifest.libraries.values()))
    return 0
