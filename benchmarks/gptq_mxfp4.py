"""MXFP4 perplexity by encoder: OCP, MSE, GPTQ, and GPTQ after activation-aware scales (AWQ),
beside bf16 and llama.cpp's Q4_1 file, on benchmarks/perplexity.py's two fixed texts.

    .venv/bin/python benchmarks/gptq_mxfp4.py [--calibration generated|FILE ...] [--damp 0.1]
        [--threads 2] [--cache ~/.cache/pdmesh/peers] [--no-llamacpp] [--lm-head]

Every GPTQ variant is a checkpoint written the way `pdmesh quantize --method gptq [--no-awq]`
writes it (shared.model.gptq.GptqEncoder into shared.model.quant_checkpoint) and loaded by the
pre-quantised loader in bf16, LM head dense, so the figures are those of a served checkpoint.
"generated" calibration is the default of `pdmesh quantize` (text the bf16 model writes itself
from generic chat prompts); a FILE is a text file's first 2048 tokens. The llama.cpp row runs
the Q4_1 GGUF (the embedded model's own file: our "dense" weights are its dequantised values)
through llama-cpp-python in the peer venv of benchmarks/peers.py, on the same token ids.

2026-12-06 23:26, SmolLM2-135M-Instruct, 2 threads, AMD EPYC Zen 4 KVM guest (avx512_bf16;
load 1.3 -> 1.8), default settings (damp 0.1, generated calibration of 4054 tokens):

  variant                                  story (521 tok)   technical (439 tok)
  dense bf16                               26.86             32.79
  llama.cpp Q4_1                           26.95  +0%        32.82  +0%
  MXFP4 OCP exponents                      43.95  +64%       52.16  +59%
  MXFP4 MSE exponents                      43.44  +62%       50.25  +53%
  GPTQ (--no-awq), 54 s                    37.23  +39%       40.05  +22%
  GPTQ + AWQ (the default), 105 s          34.39  +28%       38.29  +17%

With --lm-head (23:44, load 1.2 -> 1.8; the same rows above came out equal), LM head in MXFP4:

  MXFP4 MSE exponents                      56.20  +109%      73.75  +125%
  GPTQ (--no-awq --lm-head)                41.68  +55%       43.84  +34%
  GPTQ + AWQ (--lm-head), 125 s            38.53  +43%       41.67  +27%

Since the search measures at most 4,096 evenly spaced rows of a weight (shared/model/awq.py
SEARCH_ROWS: the head's 49,152 rows were all measured before), the head variant took 114 s
with the same figures (00:35 run, every row above equal).

The AWQ search's order inside a layer matters on these short texts: searching o_proj and
down_proj first (so qkv_proj and gate_up_proj see their final producer rows) gave 36.69 /
38.78; the order kept is AWQ's own (each group searched on the layer as it stands, qkv first).
AWQ scales with MSE rounding and no GPTQ gave 39.83 / 41.97.
See the README's performance section for the run this table is from and its command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _perplexity_module() -> ModuleType:
    # benchmarks/kernels.py shadows the kernels package for a sibling import: load by path.
    spec = importlib.util.spec_from_file_location("ppl", HERE / "perplexity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sequences(source: str, model_dir: Path, tokenizer) -> list[list[int]]:
    from shared.engine.calibration import file_sequences, generated_sequences

    if source == "generated":
        return generated_sequences(model_dir)
    return file_sequences(Path(source), tokenizer)


def _gptq_checkpoint(model_dir: Path, out: Path, seqs: list[list[int]], damp: float,
                     awq: bool, lm_head: bool) -> Path:
    """`pdmesh quantize --method gptq [--no-awq] [--lm-head]`'s checkpoint, on seqs."""
    from shared.model.gptq import GptqConfig, GptqEncoder
    from shared.model.quant import QuantConfig
    from shared.model.quant_checkpoint import write_quantized_checkpoint

    encoder = GptqEncoder(model_dir, seqs, GptqConfig(damp=damp, awq=awq, lm_head=lm_head))
    write_quantized_checkpoint(model_dir, out, QuantConfig(quantize_lm_head=lm_head),
                               packer=encoder.pack, dense=encoder.dense)
    return out


def llamacpp_perplexity(gguf: Path, texts: dict[str, list[int]], threads: int) -> dict[str, float]:
    """In the peer venv: exp(mean NLL) of each text's ids[1:] from llama.cpp's logits."""
    import numpy as np
    from llama_cpp import Llama  # only in the peer venv

    # One token per batch: ggml's AMX path crashes on batches of 2+ (see llamacpp_decode.py).
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                n_batch=1, n_ubatch=1, logits_all=True, verbose=False)
    out = {}
    for name, ids in texts.items():
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # [n-1, vocab]
        top = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        nll = logz - logits[np.arange(len(ids) - 1), ids[1:]]
        out[name] = math.exp(float(nll.mean()))
    return out


def _llamacpp_row(args: argparse.Namespace, texts: dict[str, list[int]]) -> dict[str, float]:
    sys.path.insert(0, str(HERE))
    import peer_servers as ps

    python = ps.llama_venv(args.cache) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no llama-cpp-python venv at {python.parent.parent}: run "
                         "benchmarks/peers.py once (it sets it up), or pass --no-llamacpp")
    cmd = [str(python), __file__, "--side-llamacpp", str(ps.find_q4_gguf()),
           "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, input=json.dumps(texts), capture_output=True, text=True, cwd=ROOT,
                          env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--calibration", nargs="+", default=["generated"])
    p.add_argument("--damp", type=float, default=0.1, help="fraction of mean diag(H) added")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pdmesh" / "peers")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp Q4_1 row")
    p.add_argument("--lm-head", action="store_true",
                   help="also the variants with the LM head in MXFP4 (MSE, GPTQ, GPTQ + AWQ)")
    p.add_argument("--side-llamacpp", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side_llamacpp is not None:  # the child, in the peer venv
        texts = json.loads(sys.stdin.read())
        print(json.dumps(llamacpp_perplexity(args.side_llamacpp, texts, args.threads)))
        return 0
    import torch

    sys.path.insert(0, str(ROOT))
    from shared.model.registry import resolve_model
    from shared.model.tokenizer import Tokenizer

    ppl = _perplexity_module()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tok = Tokenizer(model_dir)
    texts = {name: tok.encode(text) for name, text in ppl.TEXTS.items()}
    print(f"load average {os.getloadavg()[0]:.2f}; {' / '.join(texts)}", flush=True)
    print(f"{'variant':<48}" + "".join(f"{n:>14}" for n in texts))

    def measure(model) -> dict[str, float]:
        return {n: ppl.perplexity(model, ids) for n, ids in texts.items()}

    base = measure(ppl.load(model_dir, "bfloat16", "dense", "ocp"))
    _row("dense bf16", base, base)
    if not args.no_llamacpp:
        _row("llama.cpp Q4_1", _llamacpp_row(args, texts), base)
    for encoder in ("ocp", "mse"):
        _row(f"MXFP4 {encoder}", measure(ppl.load(model_dir, "bfloat16", "mxfp4", encoder)), base)
    if args.lm_head:
        _row("MXFP4 mse, head too",
             measure(ppl.load(model_dir, "bfloat16", "mxfp4+lm_head", "mse")), base)
    with tempfile.TemporaryDirectory(prefix="pdmesh-gptq-") as tmp:
        for source in args.calibration:
            seqs = _sequences(source, model_dir, tok)
            for awq, head in [(False, False), (True, False)] + (
                    [(False, True), (True, True)] if args.lm_head else []):
                start = time.perf_counter()
                out = _gptq_checkpoint(model_dir, Path(tmp) / f"{len(os.listdir(tmp))}", seqs,
                                       args.damp, awq, head)
                label = (f"GPTQ{' + AWQ' if awq else ''}{', head too' if head else ''} "
                         f"{Path(source).name} ({sum(map(len, seqs))} tok, "
                         f"{time.perf_counter() - start:.0f} s)")
                _row(label, measure(ppl.load(out, "bfloat16", "dense", "ocp")), base)
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


def _row(label: str, values: dict[str, float], base: dict[str, float]) -> None:
    print(f"{label:<48}" + "".join(f"{v:>8.2f} {(v / base[n] - 1) * 100:>+4.0f}%"
                                   for n, v in values.items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
