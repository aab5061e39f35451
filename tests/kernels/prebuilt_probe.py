"""Run by test_prebuilt.py in a child process: what this environment's native kernels are.

    python prebuilt_probe.py OUT_DIR   -> OUT_DIR/probe.json and OUT_DIR/outputs.pt

probe.json: the compiler tools on PATH, both libraries' build_info and the backend None picks;
outputs.pt: one call of each library's default path on fixed inputs, and of its reference.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

from kernels import dense, mxfp4

TOOLS = ("cc", "c++", "gcc", "g++", "clang", "clang++", "ninja")


def main(out: Path) -> None:
    tools = {t: shutil.which(t) for t in (*TOOLS, cpp_extension.get_cxx_compiler())}
    infos = {"mxfp4": mxfp4.build_info(), "dense": dense.build_info()}
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)  # [N, K]
    x = torch.randn(4, 256, generator=g)  # [M, K]
    blocks, scales = mxfp4.quantize(w, backend="reference")
    w16 = w.bfloat16()
    torch.save({
        "mxfp4": mxfp4.linear(x, blocks, scales),  # backend=None: the fastest runnable
        "mxfp4_reference": mxfp4.linear(x, blocks, scales, backend="reference"),
        "dense": dense.linear(x, w16),
        "dense_reference": dense.linear(x, w16, backend="reference"),
    }, out / "outputs.pt")
    doc = {
        "tools": tools,
        "ninja": cpp_extension.is_ninja_available(),
        "libraries": {name: {
            "state": info.state, "prebuilt": info.prebuilt, "library": info.library,
            "active": info.active, "available": list(info.available),
        } for name, info in infos.items()},
        "default_backend": {"mxfp4": str(mxfp4.kernel_path().backend),
                            "dense": str(dense.kernel_path().backend)},
    }
    (out / "probe.json").write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
