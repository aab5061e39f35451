"""A GGUF SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`) as a `tokenizers` BPE.

llama.cpp stores a SentencePiece BPE model (Llama 2, Mistral v0.1, TinyLlama...) as its pieces
("▁" for a space, `<0x0A>` byte pieces of type BYTE), one score per piece and no merges. The
`tokenizers` equivalent, as HF transformers' `LlamaTokenizer` builds it (and as transformers'
own GGUF loader does): a BPE over the pieces with byte fallback, merges recovered from the
scores (a piece's merges rank by its score, best first, like SentencePiece's BPE), a Metaspace
pre-tokenizer that turns spaces into "▁" and prefixes the text with one
(`tokenizer.ggml.add_space_prefix`, default true), and the matching decoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from shared.model.gguf_arch import UnsupportedGgufError

if TYPE_CHECKING:
    from shared.model.gguf_tokenizer import GgufVocab

SPACE = "\u2581"  # "▁"


def merges_from_scores(tokens: list[str], scores: list[float],
                       ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a piece into two pieces, ordered by the piece's score
    (descending), then by the lengths of left and right (descending), then by their ids: the
    order of transformers' `generate_merges(vocab, vocab_scores)`."""
    ranked: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores, strict=True):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in ids and piece[k:] in ids]
        local.sort(key=lambda m: (ids[m[0]], ids[m[1]]))
        ranked.extend(local)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _given_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise UnsupportedGgufError(f"malformed GGUF merge {merge!r}")
        pairs.append((left, right))
    return pairs


def sentencepiece_tokenizer(vocab: GgufVocab, ids: dict[str, int]) -> Tokenizer:
    """The `tokenizers.Tokenizer` for a SentencePiece GGUF vocabulary (specials added later)."""
    merges = (_given_merges(vocab.merges) if vocab.merges
              else merges_from_scores(vocab.tokens, vocab.scores, ids))
    bpe = models.BPE(vocab=ids, merges=merges, fuse_unk=True, byte_fallback=True,
                     unk_token=vocab.token(vocab.unk_token_id))
    tok = Tokenizer(bpe)
    scheme = "first" if vocab.add_space_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme,
                                                 split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok
