"""`pdmesh make-model DIR`: write a random-weight HF checkpoint with SmolLM2's tokenizer."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "Write a random-weight Llama-family HF checkpoint (SmolLM2 tokenizer) for fast tests."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="output directory (created)")
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--arch", choices=("llama", "qwen2", "mistral", "qwen3_moe"),
                        default="llama", help="qwen3_moe: 8 experts, top-2 (ModelSpec defaults)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-kv-heads", type=int, default=None,
                        help="override the preset's kv heads (1 = MQA)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="explicit head_dim (default hidden/heads)")
    parser.add_argument("--untied", action="store_true",
                        help="separate lm_head instead of tied embeddings")
    parser.add_argument("--attention-bias", action="store_true",
                        help="llama: q/k/v/o biases (qwen2 always has q/k/v bias)")
    parser.add_argument("--rope-type", choices=("default", "linear", "dynamic", "llama3"),
                        default="default")
    parser.add_argument("--rope-factor", type=float, default=4.0)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--original-max-position-embeddings", type=int, default=16,
                        help="llama3 scaling's pre-training context")
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--rope-keys", choices=("legacy", "v5"), default="legacy",
                        help="legacy rope_theta+rope_scaling, or transformers-5 rope_parameters")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="embedding / LM-head rows (default: the tokenizer's 49152); more "
                             "is a padded vocabulary")
    parser.add_argument("--padding-head-scale", type=float, default=1.0,
                        help="with --untied and a padded --vocab-size: scale the LM head's rows "
                             "past the tokenizer (2 makes greedy decoding emit such ids)")
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="copy tokenizer files from this directory instead of the embedded "
                             "SmolLM2 model")


def run(args: argparse.Namespace) -> int:
    from shared.model.make_model import ModelSpec, write_checkpoint

    try:
        spec = ModelSpec(
            arch=args.arch, preset=args.preset, seed=args.seed, num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim, tie_word_embeddings=not args.untied,
            attention_bias=args.attention_bias, rope_theta=args.rope_theta,
            rope_type=args.rope_type, rope_factor=args.rope_factor,
            original_max_position_embeddings=args.original_max_position_embeddings,
            max_position_embeddings=args.max_position_embeddings, rope_keys=args.rope_keys,
            num_shards=args.num_shards, dtype=args.dtype, vocab_size=args.vocab_size,
            padding_head_scale=args.padding_head_scale,
        )
    except ValueError as exc:
        print(f"make-model: {exc}", file=sys.stderr)
        return 2
    tokenizer_dir = args.tokenizer_from
    if tokenizer_dir is None:
        from shared.model.registry import resolve_model

        tokenizer_dir = resolve_model("smollm2-135m-instruct")
    out = write_checkpoint(args.dir, spec, tokenizer_dir)
    print(f"wrote {spec.arch} {spec.preset} checkpoint (seed {spec.seed}) to {out}")
    return 0
