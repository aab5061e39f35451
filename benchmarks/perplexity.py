"""Perplexity of fixed English texts: dense weights vs MXFP4 (with and without the LM head).

    .venv/bin/python benchmarks/perplexity.py [--model NAME_OR_DIR] [--dtype bfloat16 float32]
                                              [--threads 2] [--encoder ocp mse]
                                              [--text story technical] [--no-lm-head]
                                              [--activations float int8] [--chunk 32]

Every variant loads the same checkpoint through shared.model.loader and runs each text (a
story, TEXT, ~520 tokens; technical instructions, TECH_TEXT, ~440) as one prefill over the
paged KV cache; perplexity = exp(mean NLL of each next token). GPTQ checkpoints (which need
calibration) are measured by benchmarks/gptq_mxfp4.py on the same texts. Variants:
  dense            the checkpoint's weights in --dtype
  mxfp4            decoder linears in MXFP4, LM head dense
  mxfp4+lm_head    decoder linears and the (tied) LM head in MXFP4
each MXFP4 variant once per --encoder (how block exponents are picked: kernels/mxfp4/encoder.py).
Prefill runs more than 32 rows, so the linears dequantise exactly and call torch's matmul:
the figures measure the weight format, not the fused kernel's accumulation order.
--activations int8 adds each MXFP4 variant with int8 activations (W4A8, the fused kernel's
EngineConfig.quant_activations); those apply to decode-sized steps only, so the text then runs
as a chunked prefill of --chunk (<= 32) rows per step, and the float variants run the same
chunks beside them (the fused fp32 kernel): the difference is the activations' alone.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

# A fixed, self-written paragraph (~500 SmolLM2 tokens), so figures are comparable over time.
TEXT = """\
The old lighthouse stood at the end of a narrow spit of rock, a mile from the nearest house. \
For more than a century it had guided fishing boats home through fog and winter storms, and \
the people of the village still spoke of it as if it were a living thing. When the last keeper \
retired, the council decided to replace the lamp with an automatic beacon, and for a few years \
nobody climbed the spiral stairs at all. The paint peeled, the brass fittings turned green, and \
gulls nested on the gallery rail.

Then, one spring, a retired schoolteacher named Margaret bought the building for a single pound, \
on the condition that she restore it. Her friends thought she had lost her mind. The roof leaked, \
the windows were cracked, and the nearest hardware shop was an hour away by bus. But Margaret had \
spent forty years teaching children that difficult things are worth doing slowly and carefully, \
and she intended to follow her own advice.

She began with a list. Every morning she wrote down three tasks, no more, and every evening she \
crossed them off or carried them forward. The first week she cleared the rubbish from the ground \
floor. The second week she scraped the rust from the railings and painted them with a thick red \
primer. By midsummer she had replaced most of the windows, with help from a carpenter who had \
once been her pupil and who refused to accept any payment except tea and biscuits.

Word spread. Students from the technical college came to repair the clockwork that had once \
turned the great lens. A local historian found the keepers' logbooks in a box in the council \
archive, and read them aloud at the village hall on winter evenings. The entries were short and \
practical: the weather, the ships that passed, the amount of oil burned each night. Yet between \
the lines the audience could sense the loneliness and the pride of the men who had written them.

By the following autumn the lighthouse was open to visitors on weekends. Children climbed to the \
top and looked out over the grey water, trying to spot seals on the rocks below. Margaret sat at \
a small table by the door, selling postcards and answering questions. When people asked why she \
had taken on such an impossible project, she usually smiled and said that it had never seemed \
impossible, only long. Then she would point to the list pinned above her desk, with its three \
tasks for the day, and explain that nothing is finished all at once, but almost anything can be \
finished in the end, if somebody is patient enough to keep crossing things off.
"""

# A second fixed, self-written text (~500 tokens) in another domain (technical instructions),
# so an encoder is not judged, or tuned, on one story.
TECH_TEXT = """\
Backing up a small office network is mostly a matter of deciding what must survive and how \
quickly it must come back. Start by listing the data: shared documents, the accounting \
database, email archives, and the configuration of the router and printers. For each item, \
write down how much data there is, how often it changes, and how long the office could work \
without it. These three numbers decide the schedule far better than any product brochure.

A common rule is to keep three copies of important data, on two different kinds of storage, \
with one copy off site. In practice, the first copy is the live data on the file server. The \
second is a nightly snapshot to an external disk or a network storage box in the same \
building. The third is an encrypted upload to a remote service, or a disk that somebody takes \
home every Friday. Each copy protects against a different failure: a deleted file, a dead \
disk, or a fire.

Databases need special care. Copying the files of a running database can produce a backup \
that looks complete but cannot be opened, because the files were changing while they were \
read. Use the database's own export or dump command, or stop the service for a minute while \
the snapshot is taken. Schedule this step before the general file backup, so that the dump \
file is included in the nightly copy.

Encryption keys and passwords deserve the same attention as the data. An encrypted backup is \
useless if the only copy of its key was on the server that failed. Print the recovery key, \
seal it in an envelope, and store it with the off-site disk, or give it to two trusted people.

Finally, test the restore, not just the backup. Once a month, pick a random folder and restore \
it to a spare machine; once a year, rebuild the whole server from the backups alone, with a \
stopwatch running. Write down every step that was missing from the instructions and every \
password somebody had to look up. The result of that exercise is the real recovery plan, and \
the time it took is the honest answer to the question of how long the office can be down.
"""
TEXTS = {"story": TEXT, "technical": TECH_TEXT}

VARIANTS = ("dense", "mxfp4", "mxfp4+lm_head")


def load(model_dir: Path, dtype: str, variant: str, encoder: str, activations: str = "float"):
    from kernels.mxfp4 import Activations, Encoder
    from shared.model.loader import load_model
    from shared.model.quant import QuantConfig

    quant = None if variant == "dense" else QuantConfig(quantize_lm_head=variant.endswith("head"),
                                                        encoder=Encoder(encoder),
                                                        activations=Activations(activations))
    model, _ = load_model(model_dir, dtype, quantization=quant)
    return model


@torch.inference_mode()
def perplexity(model, ids: list[int], chunk: int = 0, block_size: int = 16) -> float:
    """exp(mean NLL) of ids[1:] given their prefixes, in one prefill over a fresh KV cache, or
    in steps of `chunk` rows over it."""
    from shared.model.attention import AttentionMetadata

    c, n = model.config, len(ids)
    num_blocks = -(-n // block_size)
    kv = torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                     dtype=model.dtype)
    step = chunk or n
    hidden = []
    for start in range(0, n, step):
        rows = min(step, n - start)
        meta = AttentionMetadata.build([start], [rows], [list(range(num_blocks))], block_size)
        hidden.append(model(torch.tensor(ids[start:start + rows]),
                            torch.arange(start, start + rows), meta, kv))  # [rows, hidden]
    logits = model.compute_logits(torch.cat(hidden)[:-1])  # [n-1, vocab] fp32
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="mean")
    return math.exp(float(nll))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", nargs="+", choices=("bfloat16", "float32"),
                   default=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--encoder", nargs="+", choices=("ocp", "mse"), default=["ocp", "mse"])
    p.add_argument("--text", nargs="+", choices=tuple(TEXTS), default=list(TEXTS))
    p.add_argument("--no-lm-head", action="store_true", help="skip the mxfp4+lm_head variant")
    p.add_argument("--activations", nargs="+", choices=("float", "int8"), default=["float"])
    p.add_argument("--chunk", type=int, default=32,
                   help="rows per step when int8 activations are measured (at most 32)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from shared.model.registry import resolve_model
    from shared.model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    texts = {name: tokenizer.encode(TEXTS[name]) for name in args.text}
    sizes = ", ".join(f"{name} {len(ids)}" for name, ids in texts.items())
    print(f"{args.model}: tokens of fixed text: {sizes}; {args.threads} threads")
    print(f"{'dtype':<10}{'variant':<24}{'text':<11}{'perplexity':>12}{'vs dense':>10}"
          f"{'seconds':>9}")
    if not 0 < args.chunk <= 32:
        p.error("--chunk must be 1..32 (int8 activations run in decode-sized steps)")
    chunk = args.chunk if "int8" in args.activations else 0
    variants = [v for v in VARIANTS if not (args.no_lm_head and v.endswith("head"))]
    runs = [("dense", "", "float")] + [(v, e, a) for e in args.encoder for v in variants
                                        for a in args.activations if v != "dense"]
    if chunk:
        print(f"every variant runs the text in steps of {chunk} rows")
    for dtype in args.dtype:
        base: dict[str, float] = {}
        for variant, encoder, acts in runs:
            model = load(model_dir, dtype, variant, encoder or "ocp", acts)
            label = f"{variant} ({encoder}{', a8' if acts == 'int8' else ''})" if encoder \
                else variant
            for name, ids in texts.items():
                start = time.perf_counter()
                ppl = perplexity(model, ids, chunk)
                elapsed = time.perf_counter() - start
                base.setdefault(name, ppl)
                print(f"{dtype:<10}{label:<24}{name:<11}{ppl:>12.3f}"
                      f"{(ppl / base[name] - 1) * 100:>+9.2f}%{elapsed:>9.2f}")
            del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
