"""The grammar layer on SmolLM2's tokenizer (no model): compile errors, the LRU cache, the
bitmask against the matcher's own acceptance, rollback, the per-request phases, and the
mask's application to logits against a plain loop."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from shared.engine.grammar import GrammarCompiler
from shared.engine.structured import (
    GrammarMask,
    GrammarPhase,
    StructuredOutputRequest,
    apply_bitmask,
)
from shared.engine.structured_spec import (
    InvalidStructuredOutput,
    StructuredKind,
    StructuredOutputSpec,
)
from shared.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99},
                                           "tag": {"enum": ["red", "green"]}},
          "required": ["n", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, frozenset(tokenizer.eos_token_ids), cache_size=8)


def spec(kind: StructuredKind, value: str, param: str = "p") -> StructuredOutputSpec:
    return StructuredOutputSpec(kind, value, param=param)


@pytest.mark.parametrize(("kind", "value", "needle"), [
    (StructuredKind.REGEX, "((", "unclosed group"),
    (StructuredKind.GRAMMAR, "start: foo", "unknown name"),
    (StructuredKind.GRAMMAR, "root ::= (", ""),
    (StructuredKind.JSON, '{"type": "foo"}', "foo"),
    (StructuredKind.JSON, '{"type": "array", "minItems": -1}', "minItems"),
    (StructuredKind.JSON, '{"properties": {"a": {"$ref": "#/$defs/x"}}}', "$defs/x"),
    (StructuredKind.JSON, '{"type": "string", "pattern": "(("}', "unclosed group"),
])
def test_bad_grammars_are_refused_with_the_field(compiler: GrammarCompiler,
                                                 kind: StructuredKind, value: str,
                                                 needle: str) -> None:
    with pytest.raises(InvalidStructuredOutput) as err:
        compiler.compile(spec(kind, value, param="guided_x"))
    assert err.value.param == "guided_x" and needle in str(err.value)


def test_cache_is_bounded_lru(tokenizer: Tokenizer) -> None:
    small = GrammarCompiler(tokenizer, frozenset(tokenizer.eos_token_ids), cache_size=2)
    a, b, c = (spec(StructuredKind.CHOICE, json.dumps([w])) for w in ("a", "b", "c"))
    first = small.compile(a)
    assert small.compile(StructuredOutputSpec(a.kind, a.value, param="other")) is first
    small.compile(b)
    small.compile(a)  # a is now the most recent: c evicts b
    small.compile(c)
    assert small.cached(a) is first and small.cached(b) is None and small.cached(c) is not None


def allowed_ids(matcher_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(matcher_row[t // 32]) >> (t % 32)) & 1}


def test_bitmask_agrees_with_the_matcher_along_a_valid_output(compiler: GrammarCompiler,
                                                              tokenizer: Tokenizer) -> None:
    grammar = compiler.compile(StructuredOutputSpec.json_schema(SCHEMA, "p"))
    m = grammar.matcher()
    text = json.dumps({"n": 42, "tag": "green"})
    rng = random.Random(0)
    row = torch.zeros(m.num_words, dtype=torch.int32)
    for token in tokenizer.encode(text, add_special_tokens=False):
        m.fill_bitmask(row)
        bits = torch.tensor([(int(row[t // 32]) >> (t % 32)) & 1 for t in range(m.vocab_size)])
        assert bits[token] == 1 and m.allows(token)
        for probe in rng.sample(range(m.vocab_size), 64):  # the mask is the matcher's verdict
            assert bool(bits[probe]) == m.allows(probe), probe
        assert m.accept(token)
    assert m.is_finished  # "}" closed the object: nothing but EOS may follow
    m.fill_bitmask(row)
    assert allowed_ids(row, m.vocab_size) == set(tokenizer.eos_token_ids)


def test_rollback_restores_the_earlier_mask(compiler: GrammarCompiler,
                                            tokenizer: Tokenizer) -> None:
    grammar = compiler.compile(spec(StructuredKind.REGEX, "[a-z]{2,6}-[0-9]{3}"))
    state = StructuredOutputRequest(grammar.spec, grammar.matcher())
    before, after = (torch.zeros(state.matcher.num_words, dtype=torch.int32) for _ in range(2))
    tokens = tokenizer.encode("abc-123", add_special_tokens=False)
    state.advance(tokens[0], tokens[:1])
    state.matcher.fill_bitmask(before)
    for i in range(1, len(tokens)):
        state.advance(tokens[i], tokens[:i + 1])
    assert state.phase is GrammarPhase.FINISHED and state.num_accepted == len(tokens)
    state.rollback(len(tokens) - 1)
    state.matcher.fill_bitmask(after)
    assert state.phase is GrammarPhase.ACTIVE and torch.equal(before, after)
    with pytest.raises(ValueError):
        state.rollback(2)


def test_phases_reasoning_then_grammar_then_failure(compiler: GrammarCompiler,
                                                    tokenizer: Tokenizer) -> None:
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    grammar = compiler.compile(spec(StructuredKind.CHOICE, '["yes", "no"]'))
    s = StructuredOutputSpec(StructuredKind.CHOICE, grammar.spec.value, reasoning_first=True,
                             reasoning_end_ids=end)
    state = StructuredOutputRequest(s, grammar.matcher())
    out: list[int] = []
    for token in tokenizer.encode("hmm, maybe", add_special_tokens=False) + list(end):
        assert state.phase is GrammarPhase.WAITING_FOR_REASONING and not state.needs_mask
        assert state.allows(token)  # free text while reasoning
        out.append(token)
        state.advance(token, out)
    assert state.phase is GrammarPhase.ACTIVE and state.num_accepted == 0
    bad = tokenizer.encode("maybe", add_special_tokens=False)[0]
    assert not state.allows(bad)
    state.advance(bad, out + [bad])
    assert state.phase is GrammarPhase.FAILED and "outside the grammar" in state.error
    manual = StructuredOutputRequest(StructuredOutputSpec(StructuredKind.CHOICE, s.value,
                                                          reasoning_first=True),
                                     grammar.matcher())
    manual.advance(5, [5])
    assert manual.phase is GrammarPhase.WAITING_FOR_REASONING
    manual.activate()
    assert manual.needs_mask


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                   vocab: int) -> torch.Tensor:
    out = logits.clone()
    for j, i in enumerate(rows):
        for t in range(logits.shape[1]):
            if t >= vocab or not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                out[i, t] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [[0, 1, 2], [1], [0, 2]])
def test_apply_bitmask_matches_a_plain_loop(rows: list[int]) -> None:
    g = torch.Generator().manual_seed(len(rows))
    vocab, width = 70, 100  # 3 words cover 96 ids; columns 70.. are a padded LM head
    logits = torch.randn(3, width, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), 3), generator=g, dtype=torch.int32)
    got = apply_bitmask(logits, bitmask, rows, vocab)
    assert torch.equal(got, reference_mask(logits, bitmask, rows, vocab))
    assert not torch.equal(got, logits) and torch.isfinite(logits).all()  # out of place


def test_grammar_mask_fill_covers_only_active_rows(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(spec(StructuredKind.CHOICE, '["red", "green"]'))
    states = [(1, StructuredOutputRequest(grammar.spec, grammar.matcher())),
              (3, StructuredOutputRequest(grammar.spec, grammar.matcher()))]
    mask = GrammarMask.fill(states)
    assert mask.rows == [1, 3] and mask.bitmask.shape == (2, (mask.vocab_size + 31) // 32)
    logits = torch.zeros(4, mask.vocab_size + 64)  # a padded LM head
    out = mask.apply(logits)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    allowed = torch.isfinite(out[1]).nonzero()[:, 0].tolist()
    assert allowed and max(allowed) < mask.vocab_size
    assert all(states[0][1].matcher.allows(t) for t in allowed)


def test_choices_with_quotes_escapes_and_unicode(compiler: GrammarCompiler,
                                                 tokenizer: Tokenizer) -> None:
    choices = ['a"b', "c\\d", "line\nbreak", "é ü", "{x}"]
    grammar = compiler.compile(StructuredOutputSpec.choice(choices, "guided_choice"))
    for text in choices + ["a", "nope"]:
        m = grammar.matcher()
        accepted = all(m.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
        assert (accepted and m.is_finished) == (text in choices), text
