"""Grammar libraries for structured output, measured on this CPU with SmolLM2's tokenizer.

    .venv/bin/pip install --no-deps --target /tmp/gramlibs xgrammar outlines-core apache-tvm-ffi
    PYTHONPATH=/tmp/gramlibs .venv/bin/python benchmarks/grammar_libs.py [--libs ...] [--steps 200]

(llguidance is a project dependency; the other two are measured from a side directory.)

For each library installed (llguidance, xgrammar, outlines-core; a missing one is skipped),
in its own child process (so a slow compile can be cut off, `--compile-timeout`):
  tokenizer  seconds to build the library's tokenizer info from tokenizer.json (once per engine);
  compile    seconds to compile the large JSON schema (below) cold, and the small one, up to
             the first mask computed (llguidance builds its lexer lazily);
  mask b1    per-token milliseconds to fill one row's bitmask [V/32] int32, median (and mean:
             string positions walk the whole token trie, structural ones are near free) over the
             tokens of a valid document of the small schema (the matcher is advanced with
             each document token, which must be allowed by the mask just computed);
  mask b16   the same for 16 matchers at staggered positions of the document (xgrammar's
             batch API; llguidance and outlines-core row by row), per step for the batch;
  advance    per-token milliseconds to advance one matcher by one token.
The bitmask is then applied to fp32 logits [B, V] by one library-independent unpacking
(numpy unpackbits, as shared/engine/structured.py does), timed once at B=1 and 16.
Schemas are compiled with no free whitespace (what the engine does).

2026-12-04, Intel Xeon with avx512_bf16 (shared 2 cores, loaded), V = 49,152:
    library        tokenizer  compile large / small   mask b1 median (mean)  mask b16 median (mean)
    llguidance     0.23 s     0.008 s / 0.0008 s      0.012 ms (0.065)       0.68 ms (0.90)
    xgrammar       1.32 s     0.033 s / 0.0066 s      0.0015 ms (0.0045)     0.067 ms (0.10)
    outlines-core  0.11 s     13.8 s  / 0.51 s        0.002 ms (0.022)       0.27 ms (0.26)
    applying the unpacked mask to fp32 logits: 0.10 ms at B=1, 1.7 ms at B=16.
llguidance was chosen: a cold compile of any schema stays in milliseconds (outlines-core's
regex-to-DFA index takes seconds), it needs no other package (xgrammar pulls in transformers,
triton and tvm-ffi and builds its tokenizer info 6x slower), it compiles Lark, GBNF, regex and
JSON schema, and its mask (under 1 ms for 16 rows) is noise beside a decode step (~100 ms at
16 rows here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/kernels.py would shadow the project's `kernels` package (imported by the model
# registry) while this script's directory is sys.path[0].
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
LIBS = ("llguidance", "xgrammar", "outlines-core")
BATCH = 16

SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 40},
        "owner": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 16}, "verified": {"type": "boolean"}},
            "required": ["first", "verified"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "kind", "age", "owner", "tags"],
    "additionalProperties": False,
}


def large_schema(n: int = 120) -> dict[str, Any]:
    """n properties cycling through strings with patterns, bounded numbers, 20-way enums,
    nested objects, arrays of objects and a shared $defs reference: a realistic big form."""
    props: dict[str, Any] = {}
    for i in range(n):
        kind = i % 6
        if kind == 0:
            props[f"id_{i}"] = {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}
        elif kind == 1:
            props[f"amount_{i}"] = {"type": "number", "minimum": 0, "maximum": 1e6}
        elif kind == 2:
            props[f"status_{i}"] = {"enum": [f"state_{j}" for j in range(20)]}
        elif kind == 3:
            props[f"address_{i}"] = {"$ref": "#/$defs/address"}
        elif kind == 4:
            props[f"items_{i}"] = {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                "type": "object", "properties": {"sku": {"type": "string"},
                                                 "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"], "additionalProperties": False}}
        else:
            props[f"note_{i}"] = {"anyOf": [{"type": "string", "maxLength": 64}, {"type": "null"}]}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False,
            "$defs": {"address": {"type": "object", "properties": {
                "street": {"type": "string"}, "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "CA", "MX", "FR", "DE"]}},
                "required": ["street", "city", "zip", "country"],
                "additionalProperties": False}}}


SMALL_DOC = {"name": "Tom the second", "kind": "cat", "age": 7,
             "owner": {"first": "Ann", "verified": True}, "tags": ["small", "grey"]}


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000.0, 4)


def _mean_ms(samples: list[float]) -> float:
    return round(statistics.fmean(samples) * 1000.0, 4)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed (token strings -> raw bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class Harness:
    """What every library is measured against: the tokenizer, the vocab rows, the doc."""

    def __init__(self) -> None:
        from shared.model.registry import resolve_model
        from shared.model.tokenizer import Tokenizer

        self.model_dir = resolve_model("smollm2-135m-instruct", progress=False)
        self.tok = Tokenizer(self.model_dir)
        self.vocab = self.tok.vocab_size
        self.words = (self.vocab + 31) // 32
        self.eos = list(self.tok.eos_token_ids)
        self.doc_ids = self.tok.encode(json.dumps(SMALL_DOC, separators=(",", ":")),
                                       add_special_tokens=False)

    def tokenizer_json(self) -> str:
        return (self.model_dir / "tokenizer.json").read_text(encoding="utf-8")


def _allowed(mask: Any, row: int, token: int) -> bool:
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)


def measure(lib: str, steps: int) -> dict[str, Any]:
    import numpy as np

    h = Harness()
    t0 = time.perf_counter()
    make, fill_batch, advance = _ADAPTERS[lib](h)
    tok_s = time.perf_counter() - t0
    mask = np.full((BATCH, h.words), -1, dtype=np.int32)
    t0 = time.perf_counter()  # compile + first mask: llguidance builds its lexer lazily
    fill_batch([make(large_schema())()], mask)
    large_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = make(SMALL_SCHEMA)
    fill_batch([compiled()], mask)
    small_s = time.perf_counter() - t0
    doc = h.doc_ids
    fills1: list[float] = []
    adv: list[float] = []
    for _ in range(max(1, steps // len(doc))):
        m = compiled()
        for token in doc:
            t0 = time.perf_counter()
            fill_batch([m], mask)
            fills1.append(time.perf_counter() - t0)
            assert _allowed(mask, 0, token), f"{lib}: document token {token} masked off"
            t0 = time.perf_counter()
            advance(m, token)
            adv.append(time.perf_counter() - t0)
    matchers = [compiled() for _ in range(BATCH)]
    pos = [0] * BATCH
    for i, m in enumerate(matchers):  # stagger: row i starts i tokens into the document
        for token in doc[: i % len(doc)]:
            advance(m, token)
        pos[i] = i % len(doc)
    fills16: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill_batch(matchers, mask)
        fills16.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            if pos[i] == len(doc):  # finished: start the row over on a fresh matcher
                matchers[i], pos[i] = compiled(), 0
                continue
            advance(m, doc[pos[i]])
            pos[i] += 1
    return {"lib": lib, "tokenizer_s": round(tok_s, 3), "compile_large_s": round(large_s, 3),
            "compile_small_s": round(small_s, 4), "mask_b1_ms": _median_ms(fills1),
            "mask_b1_mean_ms": _mean_ms(fills1), "mask_b16_ms": _median_ms(fills16),
            "mask_b16_mean_ms": _mean_ms(fills16), "advance_ms": _median_ms(adv)}


Make = Callable[[dict[str, Any]], Callable[[], Any]]
Adapter = tuple[Make, Callable[[list[Any], Any], None], Callable[[Any, int], None]]


def _llguidance(h: Harness) -> Adapter:
    import llguidance
    import llguidance.numpy as lnp

    tok = llguidance.LLTokenizer(h.tokenizer_json(), n_vocab=h.vocab, eos_token=h.eos)
    options: Any = {"whitespace_flexible": False}

    def make(schema: dict[str, Any]) -> Callable[[], Any]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        first = llguidance.LLMatcher(tok, grammar)  # compiles (lexer, token trie slices)
        assert not first.is_error(), first.get_error()
        return first.deep_copy

    def fill(matchers: list[Any], mask: Any) -> None:
        # One row after the other, as the engine does: on 2 cores LLExecutor's thread pool
        # measured slower (0.16 vs 0.09 ms for 16 rows).
        for i, m in enumerate(matchers):
            lnp.fill_next_token_bitmask(m, mask, i)

    def advance(m: Any, token: int) -> None:
        assert m.consume_token(token), m.get_error()

    return make, fill, advance


def _xgrammar(h: Harness) -> Adapter:
    import torch
    import xgrammar as xgr

    vocab = [h.tok.id_to_token(i) or "" for i in range(h.vocab)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=h.vocab,
                             stop_token_ids=h.eos)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    batch = xgr.BatchGrammarMatcher(max_threads=2)

    def make(schema: dict[str, Any]) -> Callable[[], Any]:
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                               separators=(",", ":"))
        return lambda: xgr.GrammarMatcher(grammar)

    def fill(matchers: list[Any], mask: Any) -> None:
        t = torch.from_numpy(mask)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(t, 0)
        else:
            batch.batch_fill_next_token_bitmask(matchers, t[: len(matchers)])

    def advance(m: Any, token: int) -> None:
        assert m.accept_token(token)

    return make, fill, advance


def _outlines(h: Harness) -> Adapter:
    import outlines_core as oc

    dec = _byte_decoder()
    special = set(h.tok.all_special_ids)
    tokens: dict[bytes, list[int]] = {}
    for i in range(h.vocab):
        text = h.tok.id_to_token(i)
        if text is None or i in special:
            continue
        raw = bytes(dec[c] for c in text) if all(c in dec for c in text) else text.encode()
        tokens.setdefault(raw, []).append(i)
    vocabulary = oc.Vocabulary(h.eos[0], tokens)

    def make(schema: dict[str, Any]) -> Callable[[], Any]:
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), None)
        index = oc.Index(regex, vocabulary)
        return lambda: oc.Guide(index)

    def fill(guides: list[Any], mask: Any) -> None:
        for i, g in enumerate(guides):  # no batch API
            row = mask[i]
            g.write_mask_into(row.ctypes.data, row.size, 4)

    def advance(g: Any, token: int) -> None:
        g.advance(token, return_tokens=False)

    return make, fill, advance


_ADAPTERS: dict[str, Callable[[Harness], Adapter]] = {
    "llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines}


def apply_cost() -> dict[str, float]:
    """Median ms to unpack a bitmask and mask fp32 logits [B, 49152], B = 1 and 16."""
    import numpy as np
    import torch

    from shared.engine.structured import apply_bitmask

    out = {}
    for b in (1, BATCH):
        logits = torch.randn(b, 49152)
        mask = torch.from_numpy(np.random.default_rng(0).integers(
            -(2**31), 2**31, size=(b, 49152 // 32), dtype=np.int32))
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            apply_bitmask(logits, mask, list(range(b)))
            times.append(time.perf_counter() - t0)
        out[f"apply_b{b}_ms"] = _median_ms(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--compile-timeout", type=float, default=300.0)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child mode: measure one library
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps)))
        return
    rows = []
    for lib in args.libs.split(","):
        cmd = [sys.executable, __file__, "--one", lib, "--steps", str(args.steps)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  timeout=args.compile_timeout,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      [str(ROOT), os.environ.get("PYTHONPATH", "")])})
        except subprocess.TimeoutExpired:
            rows.append({"lib": lib, "error": f"over {args.compile_timeout:.0f} s"})
            continue
        if done.returncode != 0:
            rows.append({"lib": lib, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for row in rows:
        print(json.dumps(row))
    print(json.dumps(apply_cost()))


if __name__ == "__main__":
    main()
