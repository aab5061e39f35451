"""`pdmesh quantize IN_DIR OUT_DIR --format mxfp4 [--method ocp|mse|gptq]`: write a
pre-quantised checkpoint.

--method gptq rounds with error feedback under each layer's input statistics, collected by
running the dense model over calibration text: `--calibration FILE`, or by default text the
model generates itself from generic chat prompts (shared/engine/calibration.py). Before the
rounding it folds activation-aware channel scales into the norms and producer rows that feed
each linear (shared/model/awq.py; `--no-awq` leaves them out). Same format.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from shared.config import GPTQ_METHOD, QUANTIZE_METHOD_CHOICES

if TYPE_CHECKING:  # torch stays unimported until the command runs
    from shared.model.gptq import GptqEncoder

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
    parser.add_argument("--method", choices=QUANTIZE_METHOD_CHOICES, default=None,
                        help="ocp (the OCP MX exponent rule), mse (least squared error per "
                             "block; the default) or gptq (error feedback over calibration "
                             "text: lowest perplexity, takes minutes); same format")
    parser.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                        help="with --method gptq: UTF-8 calibration text (first 2048 tokens; "
                             "default: text the model generates from generic chat prompts)")
    parser.add_argument("--damp", type=float, default=None,
                        help="with --method gptq: fraction of mean(diag(H)) added to H's "
                             "diagonal (default 0.1)")
    parser.add_argument("--awq", action=argparse.BooleanOptionalAction, default=None,
                        help="with --method gptq: fold activation-aware channel scales into the "
                             "norms and producer rows before rounding (default: on, for the "
                             "pre-norm decoder families; others are rounded without)")
    parser.add_argument("--backend", default=None,
                        help="kernels.mxfp4 backend (default: fastest; results are identical)")


def run(args: argparse.Namespace) -> int:
    from shared.model.quant import DEFAULT_ENCODER, QuantConfig, QuantMethod, parse_encoder
    from shared.model.quant_checkpoint import check_paths, write_quantized_checkpoint
    from shared.model.registry import resolve_model

    gptq = args.method == GPTQ_METHOD
    try:
        if not gptq and (args.calibration is not None or args.damp is not None
                         or args.awq is not None):
            raise ValueError("--calibration, --damp and --awq go with --method gptq")
        quant = QuantConfig(method=QuantMethod(args.format), quantize_lm_head=args.lm_head,
                            backend=args.backend,
                            encoder=DEFAULT_ENCODER if gptq
                            else parse_encoder(args.method or DEFAULT_ENCODER))
        in_dir = resolve_model(args.in_dir)
        check_paths(in_dir, args.out_dir)
        start = time.perf_counter()
        encoder = _gptq_encoder(args, in_dir, quant.lm_head) if gptq else None
        report = write_quantized_checkpoint(
            in_dir, args.out_dir, quant, packer=encoder.pack if encoder else None,
            dense=encoder.dense if encoder else None)
    except (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError) as exc:
        print(f"quantize: {exc}", file=sys.stderr)
        return 2
    mib = 1 << 20
    how = f"{quant.encoder} exponents"
    if encoder is not None:
        how = GPTQ_METHOD + (f" after activation-aware scales on {len(encoder.folded)} layers"
                             if encoder.folded else "")
    print(f"wrote {report.out_dir} in {time.perf_counter() - start:.0f} s: "
          f"{report.num_quantized} weights quantised to {args.format} with {how} "
          f"({report.dense_bytes / mib:.1f} MiB -> {report.packed_bytes / mib:.1f} MiB), "
          f"{report.num_copied} tensors copied; files: {', '.join(report.files)}")
    return 0


def _gptq_encoder(args: argparse.Namespace, model_dir: Path, lm_head: bool) -> GptqEncoder:
    """Calibrate (the slow part: minutes) and return the GPTQ encoder."""
    from kernels.mxfp4.gptq import DEFAULT_DAMP
    from shared.engine.calibration import file_sequences, generated_sequences
    from shared.model.gptq import GptqConfig, GptqEncoder
    from shared.model.tokenizer import Tokenizer

    config = GptqConfig(damp=DEFAULT_DAMP if args.damp is None else args.damp, lm_head=lm_head,
                        awq=args.awq is not False)
    if args.calibration is not None:
        sequences = file_sequences(args.calibration, Tokenizer(model_dir))
        source = str(args.calibration)
    else:
        sequences = generated_sequences(model_dir)
        source = "generated by the model"
    print(f"gptq: {sum(map(len, sequences))} calibration tokens ({source}), damp "
          f"{config.damp}", file=sys.stderr)
    return GptqEncoder(model_dir, sequences, config, progress=sys.stderr.isatty())
