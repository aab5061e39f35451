"""Prompts for a benchmark run: random, prefix-repetition, or a JSONL file.

Random prompts are drawn (seeded) from a pool of token ids: the ids of a fixed list of common
English words, as the server's tokenizer splits them. A pool of ordinary word pieces keeps
special tokens (BOS, EOS, chat markers) out of the prompts and makes decode -> re-encode stable,
so a text prompt lands on the requested length (vLLM's decode-to-target-length loop). With no
tokenizer at all the prompts are plain words, about one token each, and lengths come from the
server's usage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.bench.config import BenchConfig, DatasetKind, PromptFormat
from services.bench.tokenizer import TokenCodec

DEFAULT_NUM_PROMPTS = 1000  # vLLM's default
MAX_LENGTH_FIX_ROUNDS = 10

WORDS = tuple("""
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education foot boy age policy process music market
sense nation plan college interest death experience effect class control care field development
role effort rate heart drug show leader light voice wife police mind price report decision son
view relationship town road arm difference value building action model season society tax
director position player record paper space ground form event official matter center couple
site project activity star table need court oil situation cost industry figure street image
""".split())


class DatasetError(ValueError):
    """Bad dataset input (file, flags) or a tokenizer that cannot serve it."""


@dataclass(frozen=True)
class Prompt:
    """One request's input. prompt_len is the token count when known before sending."""

    prompt: str | list[int]
    prompt_len: int | None
    output_len: int


async def build_prompts(config: BenchConfig, codec: TokenCodec | None) -> list[Prompt]:
    """The run's prompts, in send order (deterministic for a given seed and tokenizer)."""
    rng = np.random.default_rng(config.seed)
    kind = config.dataset.kind
    if kind is DatasetKind.JSONL:
        return await jsonl_prompts(config, codec)
    count = config.num_prompts or DEFAULT_NUM_PROMPTS
    if codec is None:
        return word_prompts(config, count, rng)
    pool = await token_pool(codec)
    if kind is DatasetKind.RANDOM:
        return [await _random_prompt(config, codec, pool, rng) for _ in range(count)]
    return await prefix_prompts(config, codec, pool, rng, count)


async def token_pool(codec: TokenCodec) -> list[int]:
    ids = sorted(set(await codec.encode(" " + " ".join(WORDS))))
    if len(ids) < 16:
        raise DatasetError(f"tokenizer {codec.source} produced only {len(ids)} distinct ids")
    return ids


def _draw(pool: list[int], n: int, rng: np.random.Generator) -> list[int]:
    return [pool[i] for i in rng.integers(0, len(pool), size=n)]


async def fit_text(codec: TokenCodec, ids: list[int], target: int, pool: list[int],
                   rng: np.random.Generator) -> tuple[str, int]:
    """Decode ids to text whose re-encoding has `target` tokens (best effort, vLLM's loop)."""
    text = await codec.decode(ids)
    for _ in range(MAX_LENGTH_FIX_ROUNDS):
        ids = await codec.encode(text)
        if len(ids) == target:
            return text, target
        ids = ids[:target] if len(ids) > target else ids + _draw(pool, target - len(ids), rng)
        text = await codec.decode(ids)
    return text, len(await codec.encode(text))


async def _random_prompt(config: BenchConfig, codec: TokenCodec, pool: list[int],
                         rng: np.random.Generator) -> Prompt:
    ids = _draw(pool, config.input_len, rng)
    if config.wire_format is PromptFormat.IDS:
        return Prompt(ids, len(ids), config.output_len)
    text, length = await fit_text(codec, ids, config.input_len, pool, rng)
    return Prompt(text, length, config.output_len)


async def prefix_prompts(config: BenchConfig, codec: TokenCodec, pool: list[int],
                         rng: np.random.Generator, count: int) -> list[Prompt]:
    """`num_prefixes` groups; each prompt is its group's shared prefix plus a random suffix."""
    prefix_len = min(config.prefix_len, config.input_len)
    suffix_len = config.input_len - prefix_len
    prefixes = [_draw(pool, prefix_len, rng) for _ in range(config.num_prefixes)]
    text_mode = config.wire_format is PromptFormat.TEXT
    prefix_texts = [await codec.decode(p) for p in prefixes] if text_mode else []
    prompts: list[Prompt] = []
    for i in range(count):
        group = i % config.num_prefixes
        suffix = _draw(pool, suffix_len, rng)
        if not text_mode:
            ids = prefixes[group] + suffix
            prompts.append(Prompt(ids, len(ids), config.output_len))
            continue
        # The prefix text is reused verbatim, so every prompt of a group shares its tokens.
        text = prefix_texts[group] + (await codec.decode(suffix) if suffix else "")
        prompts.append(Prompt(text, len(await codec.encode(text)), config.output_len))
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order]


def word_prompts(config: BenchConfig, count: int, rng: np.random.Generator) -> list[Prompt]:
    """No tokenizer: words drawn from WORDS, about one token each; lengths come from usage."""
    if config.prompt_format is PromptFormat.IDS:
        raise DatasetError("--prompt-format ids needs a tokenizer: the server has no /tokenize; "
                         "pass --tokenizer-model")
    shared = config.dataset.kind is DatasetKind.PREFIX_REPETITION
    prefix_len = min(config.prefix_len, config.input_len) if shared else 0
    prefixes = [_words(prefix_len, rng) for _ in range(config.num_prefixes)] if shared else []
    prompts = []
    for i in range(count):
        head = prefixes[i % len(prefixes)] + " " if prefixes else ""
        prompts.append(Prompt(head + _words(config.input_len - prefix_len, rng), None,
                              config.output_len))
    return prompts


def _words(n: int, rng: np.random.Generator) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n))


def read_jsonl(path: Path) -> list[tuple[str | list[int], int | None]]:
    """(prompt, output_len or None) per non-empty line; raises ValueError naming the line."""
    entries: list[tuple[str | list[int], int | None]] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        raw = obj.get("prompt") if isinstance(obj, dict) else None
        prompt: str | list[int]
        if isinstance(raw, str) and raw:
            prompt = raw
        elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
            prompt = raw
        else:
            raise DatasetError(f"{path}:{lineno}: needs a non-empty \"prompt\" (text or token ids)")
        out = obj.get("output_len")
        if out is not None and (not isinstance(out, int) or out < 1):
            raise DatasetError(f"{path}:{lineno}: \"output_len\" must be an int >= 1")
        entries.append((prompt, out))
    if not entries:
        raise DatasetError(f"{path}: no prompts")
    return entries


async def jsonl_prompts(config: BenchConfig, codec: TokenCodec | None) -> list[Prompt]:
    """Lines in file order, cycled when --num-prompts asks for more than the file holds."""
    assert config.dataset.path is not None
    entries = read_jsonl(config.dataset.path)
    count = config.num_prompts or len(entries)
    prompts = []
    for i in range(count):
        prompt, out = entries[i % len(entries)]
        prompt = await _as_wire(prompt, config, codec)
        length = len(prompt) if isinstance(prompt, list) else (
            len(await codec.encode(prompt)) if codec else None)
        prompts.append(Prompt(prompt, length, out or config.output_len))
    return prompts


async def _as_wire(prompt: str | list[int], config: BenchConfig,
                   codec: TokenCodec | None) -> str | list[int]:
    """A JSONL prompt goes as written unless the endpoint or --prompt-format needs the other form."""
    want = config.wire_format if config.prompt_format is not PromptFormat.AUTO else None
    if want is None and isinstance(prompt, list) and config.wire_format is PromptFormat.TEXT:
        want = PromptFormat.TEXT  # chat needs text
    if want is PromptFormat.TEXT and isinstance(prompt, list):
        if codec is None:
            raise DatasetError("token-id prompts on this endpoint need a tokenizer to decode them")
        return await codec.decode(prompt)
    if want is PromptFormat.IDS and isinstance(prompt, str):
        if codec is None:
            raise DatasetError("--prompt-format ids needs a tokenizer to encode text prompts")
        return await codec.encode(prompt)
    return prompt
