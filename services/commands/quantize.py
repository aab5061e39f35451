"""`pdmesh quantize IN_DIR OUT_DIR --format mxfp4 [--method ocp|mse]`: write a pre-quantised
checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.config import QUANT_ENCODER_CHOICES

HELP = "Write an MXFP4 pre-quantised copy of an HF checkpoint (loads without re-quantising)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("in_dir", help="source HF checkpoint directory (or a known model name)")
    parser.add_argument("out_dir", type=Path, help="output directory (created; must be empty)")
    parser.add_argument("--format", choices=("mxfp4",), default="mxfp4")
    head = parser.add_mutually_exclusive_group()
    head.add_argument("--lm-head", dest="lm_head", action="store_true", default=None,
                      help="also quantise the LM head (faster decode, much higher perplexity)")
    head.add_argument("--no-lm-head", dest="lm_head", action="store_false",
                      help="keep the LM head dense (the default)")
    parser.add_argument("--method", choices=QUANT_ENCODER_CHOICES, default=None,
                        help="how each block's exponent is picked: ocp (the OCP MX rule) or mse "
                             "(least squared error per block; the default); same format")
    parser.add_argument("--backend", default=None,
                        help="kernels.mxfp4 backend (default: fastest; results are identical)")


def run(args: argparse.Namespace) -> int:
    from shared.model.quant import DEFAULT_ENCODER, QuantConfig, QuantMethod, parse_encoder
    from shared.model.quant_checkpoint import write_quantized_checkpoint
    from shared.model.registry import resolve_model

    try:
        quant = QuantConfig(method=QuantMethod(args.format), quantize_lm_head=args.lm_head,
                            backend=args.backend,
                            encoder=parse_encoder(args.method or DEFAULT_ENCODER))
        report = write_quantized_checkpoint(resolve_model(args.in_dir), args.out_dir, quant)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"quantize: {exc}", file=sys.stderr)
        return 2
    mib = 1 << 20
    print(f"wrote {report.out_dir}: {report.num_quantized} weights quantised to {args.format} "
          f"with {quant.encoder} exponents ({report.dense_bytes / mib:.1f} MiB -> {report.packed_bytes / mib:.1f} MiB), "
          f"{report.num_copied} tensors copied; files: {', '.join(report.files)}")
    return 0
