"""The grammar mask in the engine on tiny random models: sampled outputs validate against
their schema (jsonschema), other rows of the batch are untouched, a padded LM head's extra
rows are never picked, a prefill/decode split gives the single engine's tokens, and the
grammar's end stops a request."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.outputs import FinishReason
from shared.engine.request import PrefilledKV
from shared.engine.sampler import SamplingTensors
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured_spec import (
    InvalidStructuredOutput,
    StructuredKind,
    StructuredOutputSpec,
)
from shared.model.make_model import VOCAB_SIZE
from tests.support.engine import assert_all_blocks_free, random_prompts, run_engine

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 8}, "verified": {"type": "boolean"}},
            "required": ["first", "verified"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3},
    },
    "required": ["name", "kind", "age", "owner", "tags"],
    "additionalProperties": False,
}
PET_SPEC = StructuredOutputSpec.json_schema(PET, "response_format")
PROMPTS = random_prompts([5, 19, 33, 8], seed=3)


def engine_for(ckpt: Path, **overrides: object) -> LLMEngine:
    fields = {"model": str(ckpt), "dtype": "float32", "kv_cache_memory_bytes": 8 << 20,
              "num_threads": 1, **overrides}
    return LLMEngine.from_config(EngineConfig(**fields))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(preset="tiny", tie_word_embeddings=False, seed=0)


@pytest.fixture(scope="module")
def engine(tiny: Path) -> LLMEngine:
    return engine_for(tiny)


def test_sampled_outputs_validate_and_plain_rows_are_untouched(engine: LLMEngine) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = run_engine(engine, PROMPTS[:2], [plain, plain])
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured=PET_SPEC)
               for s in range(10)]
    prompts = [PROMPTS[i % 4] for i in range(10)] + PROMPTS[:2]
    outs = run_engine(engine, prompts, sampled + [plain, plain])
    for i in range(10):
        assert outs[i].finish_reason is FinishReason.STOP, outs[i].text
        jsonschema.validate(json.loads(outs[i].text), PET)
    assert [outs[10].token_ids, outs[11].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(("structured", "check"), [
    (StructuredOutputSpec.choice(["yes", "no", "maybe so"], "guided_choice"),
     lambda t: t in ("yes", "no", "maybe so")),
    (StructuredOutputSpec.text(StructuredKind.REGEX, r"[A-Z][a-z]{2,5}-[0-9]{2}", "guided_regex"),
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{2}", t) is not None),
    (StructuredOutputSpec.text(StructuredKind.GRAMMAR,
                               'root ::= "(" d ("+" d)? ")"\nd ::= [0-9]', "guided_grammar"),
     lambda t: re.fullmatch(r"\(\d(\+\d)?\)", t) is not None),
], ids=["choice", "regex", "gbnf"])
def test_bounded_kinds_end_by_their_grammar(engine: LLMEngine, structured: StructuredOutputSpec,
                                            check: Callable[[str], bool]) -> None:
    params = [SamplingParams(temperature=t, seed=s, max_tokens=60, structured=structured,
                             min_tokens=4) for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    outs = run_engine(engine, PROMPTS[:3], params)
    for out in outs.values():  # min_tokens does not hold a finished grammar back
        assert out.finish_reason is FinishReason.STOP and check(out.text), out.text


def test_json_object_output_is_a_prefix_the_grammar_accepts(engine: LLMEngine) -> None:
    """Unbounded (a random model writes long strings): every token cut short by max_tokens is
    still accepted by a fresh matcher of the same grammar, the library's own verdict."""
    spec = StructuredOutputSpec(StructuredKind.JSON_OBJECT, param="response_format")
    outs = run_engine(engine, PROMPTS[:2], [SamplingParams(temperature=1.0, seed=s,
                                                           max_tokens=40, structured=spec)
                                            for s in (4, 5)])
    for out in outs.values():
        matcher = engine.grammars.compile(spec).matcher()
        assert out.text.startswith("{")
        assert all(matcher.accept(t) for t in out.token_ids)
        if out.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(out.text), dict)


def test_no_grammar_in_the_batch_builds_no_mask(engine: LLMEngine) -> None:
    req = engine.add_request("plain", PROMPTS[0], SamplingParams(max_tokens=2))
    assert SamplingTensors.from_requests([req], VOCAB_SIZE).grammar is None
    engine.abort_request("plain")
    engine.step()


def test_padded_vocab_rows_are_masked_off(padded_vocab_ckpt: Path) -> None:
    eng = engine_for(padded_vocab_ckpt)
    free = run_engine(eng, PROMPTS[:1], [SamplingParams(temperature=0.0, max_tokens=24,
                                                        ignore_eos=True)])
    assert max(free[0].token_ids) >= VOCAB_SIZE  # unconstrained, this head picks padding rows
    regex = StructuredOutputSpec.text(StructuredKind.REGEX, "[a-z ]{1,40}", "guided_regex")
    params = [SamplingParams(temperature=t, seed=3, max_tokens=160, structured=s)
              for t in (0.0, 1.0) for s in (regex, PET_SPEC)]
    outs = run_engine(eng, PROMPTS, params)
    for out in outs.values():
        assert max(out.token_ids) < VOCAB_SIZE
    jsonschema.validate(json.loads(outs[1].text), PET)
    assert re.fullmatch("[a-z ]{1,40}", outs[0].text)


def prefill(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> int:
    engine.add_request(rid, prompt, dataclasses.replace(params, max_tokens=1), hold_kv=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1].token_ids[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_prefill_decode_split_equals_one_engine(tiny: Path, engine: LLMEngine,
                                                temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=160,
                            structured=PET_SPEC)
    expected = run_engine(engine, PROMPTS, [params] * len(PROMPTS))
    p_engine, d_engine = engine_for(tiny), engine_for(tiny)
    for i, prompt in enumerate(PROMPTS):
        first = prefill(p_engine, f"p{i}", prompt, params)
        dst = d_engine.allocate_blocks(len(prompt))
        assert dst is not None
        d_engine.runner.kv_cache[:, :, dst] = p_engine.runner.kv_cache[
            :, :, p_engine.held_block_ids(f"p{i}")]
        p_engine.release_held(f"p{i}")
        d_engine.add_request(f"req-{i}", prompt, params,
                             prefilled=PrefilledKV(tuple(dst), len(prompt), first))
    streamed: dict[str, list[int]] = {}
    while d_engine.has_unfinished_requests():
        for out in d_engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i in range(len(PROMPTS)):
        assert streamed[f"req-{i}"] == expected[i].token_ids, i
    assert_all_blocks_free(p_engine)
    assert_all_blocks_free(d_engine)


def test_a_prefilled_token_outside_the_grammar_is_refused(engine: LLMEngine) -> None:
    prompt = PROMPTS[0]
    dst = engine.allocate_blocks(len(prompt))
    assert dst is not None
    outside = engine.tokenizer.encode("hello", add_special_tokens=False)[0]  # JSON starts "{"
    params = SamplingParams(temperature=0.0, max_tokens=8, structured=PET_SPEC)
    with pytest.raises(ValueError, match="outside the request's grammar"):
        engine.add_request("bad", prompt, params,
                           prefilled=PrefilledKV(tuple(dst), len(prompt), outside))
    engine.free_blocks(dst)


def test_an_engine_that_samples_elsewhere_refuses_structured_output(engine: LLMEngine) -> None:
    """A pipeline's stage 0 (any runner but ModelRunner) has no grammar at its sampler."""
    stage = SimpleNamespace(kv_cache=engine.runner.kv_cache, num_blocks=engine.runner.num_blocks,
                            block_size=engine.config.block_size)
    other = LLMEngine(engine.config, engine.model_config, engine.tokenizer, stage)
    with pytest.raises(InvalidStructuredOutput, match="pipeline"):
        other.validate(PROMPTS[0], SamplingParams(structured=PET_SPEC))


def test_activation_after_reasoning(engine: LLMEngine) -> None:
    """reasoning_first: free text until activated (here by the engine hook), JSON after."""
    spec = StructuredOutputSpec(StructuredKind.CHOICE, '["yes", "no"]', reasoning_first=True)
    req = engine.add_request("think", PROMPTS[1], SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, structured=spec))
    for _ in range(3):
        engine.step()
    assert req.structured is not None and not req.structured.needs_mask
    free = len(req.output_token_ids)
    assert engine.activate_structured("think") and not engine.activate_structured("nope")
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.text
    assert out.finish_reason is FinishReason.STOP and free >= 2
    answer = engine.tokenizer.decode(req.output_token_ids[free:])
    assert answer in ("yes", "no") and text.endswith(answer)
