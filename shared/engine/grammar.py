"""Compiling structured-output specs into token matchers (llguidance), cached per spec.

Why llguidance (benchmarks/grammar_libs.py, SmolLM2's 49,152-token vocabulary, 2 cores):
its tokenizer info builds in ~0.2 s (xgrammar ~1.3 s), a 120-property schema compiles to its
first mask in ~10 ms (xgrammar ~30 ms, outlines-core ~14 s), a mask costs 0.01-0.06 ms per
row (xgrammar is ~10x faster there, but both are noise beside a decode step), and it brings
no further dependencies. Its parser limits (lexer fuel, Earley items per step)
bound the work of any one mask, so no grammar can stall the engine thread for long.

`GrammarCompiler` is thread-safe: the services compile on a helper thread (with a deadline,
AsyncEngine.compile_grammar) so that a bad grammar is a 400 before anything streams, and the
engine thread then finds the result in the cache when the request is added. Compiling builds
the matcher and its first mask (llguidance builds lexer states lazily, at the first mask).
A `CompiledGrammar` is immutable once cached; every request gets a deep copy of its matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
import torch

from shared.engine.structured_spec import (
    InvalidStructuredOutput,
    StructuredKind,
    StructuredOutputSpec,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from shared.model.tokenizer import Tokenizer

# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): what models have seen most, and no
# free whitespace, which small models fill forever once allowed.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type":"object"}'


class GrammarMatcher:
    """One request's position in its grammar; a thin typed view of an llguidance matcher."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size  # tokens the mask covers (the tokenizer's)

    @property
    def num_words(self) -> int:
        """int32 words of one bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` [num_words] int32 (contiguous): bit j of
        word w allows token 32*w + j."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.numel() == self.num_words
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and the matcher is then in error) if not allowed."""
        return self._m.consume_token(token_id)

    def allows(self, token_id: int) -> bool:
        """Whether `token_id` may come next (the matcher does not move)."""
        return self._m.validate_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding's rejections)."""
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (or it is in error)."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


class CompiledGrammar:
    """A spec compiled against one tokenizer; `matcher()` starts a request on it."""

    def __init__(self, spec: StructuredOutputSpec, template: llguidance.LLMatcher,
                 vocab_size: int) -> None:
        self.spec = spec
        self._template = template  # never advanced: copied for each request
        self.vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size)


def grammar_text(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar of a spec; raises InvalidStructuredOutput if it cannot convert."""
    param = spec.param or spec.kind.value
    try:
        if spec.kind is StructuredKind.JSON:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
        if spec.kind is StructuredKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
        if spec.kind is StructuredKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind is StructuredKind.CHOICE:
            # Lark string literals take JSON's escapes.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False)
                                      for c in json.loads(spec.value))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.grammar_from("grammar", spec.value)  # Lark, or GBNF converted
    except ValueError as exc:
        raise InvalidStructuredOutput(f"{param}: {exc}", param) from None


class GrammarCompiler:
    """Specs -> CompiledGrammars for one tokenizer, with a bounded LRU cache (thread-safe).

    The llguidance tokenizer (token trie over the vocabulary, ~0.2 s) is built at the first
    compile, once per engine; `eos_token_ids` are the tokens allowed where the grammar may end.
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int],
                 cache_size: int = 128) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self._tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                tok = self._tokenizer
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=self._eos)
            return self._ll_tokenizer

    def cached(self, spec: StructuredOutputSpec) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
            return hit

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The cached grammar of `spec`, compiled now if needed (two threads compiling the
        same spec at once both work; one result is kept). Raises InvalidStructuredOutput."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        compiled = self._build(spec)
        with self._lock:
            self._cache[spec.key] = compiled
            self._cache.move_to_end(spec.key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        tokenizer = self._llg_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # builds the lexer; errors a lazy stage finds show now
        if matcher.is_error():
            param = spec.param or spec.kind.value
            raise InvalidStructuredOutput(
                f"{param}: cannot compile the {spec.kind.value} constraint: {matcher.get_error()}",
                param)
        return CompiledGrammar(spec, matcher, tokenizer.vocab_size)
