"""`pdmesh generate`: one prompt (or one chat turn) through the offline engine, streamed."""

from __future__ import annotations

import argparse
import sys

from kernels.tier import TIER_CHOICES
from shared.config import (
    DEFAULT_MODEL,
    DTYPE_CHOICES,
    QUANT_ACTIVATION_CHOICES,
    QUANTIZE_METHOD_CHOICES,
)

HELP = "Generate text for one prompt (--prompt) or one chat message (--chat) offline."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model name, HF directory or org/name from the local Hugging Face "
                             "cache (never downloaded)")
    parser.add_argument("--revision", default=None,
                        help="with an org/name --model: branch, tag or full commit hash "
                             "(default: main)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw text prompt (no chat template)")
    source.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto: bfloat16 where a native kernel tier runs, else float32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--quantization", choices=("mxfp4",), default=None)
    parser.add_argument("--quant-encoder", choices=QUANTIZE_METHOD_CHOICES, default=None,
                        help="with --quantization: ocp or mse block exponents (default mse; "
                             "gptq only through `pdmesh quantize --method gptq`)")
    parser.add_argument("--quant-activations", choices=QUANT_ACTIVATION_CHOICES, default="float",
                        help="with --quantization: float, or int8 activations (W4A8)")
    parser.add_argument("--kernel-tier", default=None, choices=TIER_CHOICES,
                        help="highest native kernel tier (default: $PDMESH_KERNEL_TIER, else auto)")
    parser.add_argument("--stats", action="store_true", help="print token counts and speed")


def run(args: argparse.Namespace) -> int:
    import time

    from shared.config import EngineConfig, kernel_tier_from_env
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        config = EngineConfig(model=args.model, revision=args.revision, dtype=args.dtype,
                              num_threads=args.threads,
                              quantization=args.quantization,
                              quant_encoder=args.quant_encoder,
                              quant_activations=args.quant_activations,
                              kernel_tier=args.kernel_tier or kernel_tier_from_env())
        engine = LLMEngine.from_config(config)
        tok = engine.tokenizer
        if args.chat is not None:
            text = tok.apply_chat_template([{"role": "user", "content": args.chat}])
            prompt = tok.encode(text, add_special_tokens=False)
        else:
            prompt = tok.encode(args.prompt)
        engine.add_request("cli", prompt, params)
    except (ValueError, NotImplementedError, FileNotFoundError) as exc:
        print(f"generate: {exc}", file=sys.stderr)
        return 2
    start, first, final = time.perf_counter(), None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_text:
                first = first or time.perf_counter()
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            final = out
    sys.stdout.write("\n")
    if args.stats and final is not None:
        elapsed = time.perf_counter() - start
        n = len(final.token_ids)
        ttft = (first or time.perf_counter()) - start
        print(f"[{len(prompt)} prompt tokens, {n} generated in {elapsed:.2f}s "
              f"({n / elapsed:.1f} tok/s), TTFT {ttft * 1000:.0f} ms, "
              f"finish: {final.finish_reason.value if final.finish_reason else '-'}]",
              file=sys.stderr)
    return 0
