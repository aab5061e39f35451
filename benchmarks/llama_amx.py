"""llama.cpp on CPUs with AMX: turn off its AMX weight repacking, for batched evaluation.

    <llama venv>/bin/python benchmarks/llama_amx.py SERVER_ARGS...   # llama_cpp.server, patched

llama-cpp-python 0.3.36 built with GGML_NATIVE on an AMX CPU (Intel Xeon, amx_int8) repacks
weights at load for its AMX / VNNI int8 kernels (its "extra buffer types"), and then segfaults
on any batch of two or more tokens: every prompt. Single-token decode works and is its
fastest path, so benchmarks/llamacpp_decode.py keeps the repacking and feeds prompts one
token per batch; the prefill benchmark and the server (benchmarks/peer_servers.py) turn it off
here. Runs inside the llama venv only; on other CPUs it changes nothing.
"""

from __future__ import annotations

import runpy
from pathlib import Path


def cpu_has_amx() -> bool:
    return "amx_int8" in Path("/proc/cpuinfo").read_text()


def disable_repacking_on_amx() -> None:
    """Make every later llama_cpp.Llama load its weights without extra buffer types."""
    if not cpu_has_amx():
        return
    from llama_cpp import llama as llama_module  # only in the peer venv

    default_params = llama_module.llama_cpp.llama_model_default_params

    def no_extra_bufts():  # a ctypes llama_model_params struct
        params = default_params()
        params.use_extra_bufts = False
        return params

    llama_module.llama_cpp.llama_model_default_params = no_extra_bufts


if __name__ == "__main__":
    disable_repacking_on_amx()
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
