"""The offline LLM API and the output processor: prompt forms, n>1 fan-out, stop strings,
stop token ids, min_tokens, max_tokens / context length, logprobs vs HF, text vs decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine import LLM, FinishReason, SamplingParams
from tests.support.engine import random_prompts

PROMPTS = random_prompts([6, 21, 13], seed=11)
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(small_ckpt) -> LLM:
    return LLM(model=str(small_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, num_threads=1)


@pytest.fixture(scope="module")
def full(llm) -> list:
    return llm.generate(PROMPTS, GREEDY)


def test_prompt_forms_and_text_matches_decode(llm, full):
    text_prompt = "The capital of France is"
    by_text = llm.generate(text_prompt, GREEDY)
    by_ids = llm.generate(llm.tokenizer.encode(text_prompt), GREEDY)
    assert len(by_text) == len(by_ids) == 1
    assert by_text[0].token_ids == by_ids[0].token_ids
    assert by_text[0].prompt == text_prompt and by_ids[0].prompt is None
    assert [o.token_ids for o in llm.generate([PROMPTS[1]], GREEDY)] == [full[1].token_ids]
    for out in full:
        assert len(out.token_ids) == 30 and out.finish_reason == FinishReason.LENGTH
        assert out.text == llm.tokenizer.decode(out.token_ids)
    with pytest.raises(ValueError):
        llm.generate([], GREEDY)


def test_n_choices_fan_out_with_derived_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    [out] = llm.generate([PROMPTS[0]], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    [single] = llm.generate([PROMPTS[0]], params.for_choice(0))
    assert out.outputs[0].token_ids == single.token_ids


def test_stop_token_ids_keep_the_token_but_not_its_text(llm, full):
    ref = full[0].token_ids
    stop_tok = ref[7]
    k = ref.index(stop_tok)
    [out] = llm.generate([PROMPTS[0]], dataclasses.replace(GREEDY, stop_token_ids=(stop_tok,)))
    assert out.token_ids == ref[:k + 1]
    assert out.finish_reason == FinishReason.STOP and out.outputs[0].stop_reason == stop_tok
    assert out.text == llm.tokenizer.decode(ref[:k])


def test_stop_strings_cut_text_with_or_without_the_stop(llm, full):
    ref = full[1]
    stop = next(s for s in (llm.tokenizer.decode([t]) for t in ref.token_ids[8:]) if s.strip())
    cut = ref.text.index(stop)
    params = dataclasses.replace(GREEDY, stop=(stop,))
    [out] = llm.generate([PROMPTS[1]], params)
    assert out.text == ref.text[:cut]
    assert out.finish_reason == FinishReason.STOP and out.outputs[0].stop_reason == stop
    assert ref.token_ids[:len(out.token_ids)] == out.token_ids
    [incl] = llm.generate([PROMPTS[1]], dataclasses.replace(params, include_stop_str_in_output=True))
    assert incl.text == ref.text[:cut + len(stop)]


def test_min_tokens_masks_stop_ids_until_reached(llm, full):
    ref = full[2].token_ids
    params = dataclasses.replace(GREEDY, stop_token_ids=(ref[0],), min_tokens=3, max_tokens=8)
    [out] = llm.generate([PROMPTS[2]], params)
    assert ref[0] not in out.token_ids[:3] and len(out.token_ids) >= 3


def test_context_length_ends_with_length(small_ckpt):
    llm = LLM(model=str(small_ckpt), max_model_len=20, kv_cache_memory_bytes=1 << 20, num_threads=1)
    [out] = llm.generate([list(range(5, 20))], SamplingParams(temperature=0.0, max_tokens=None,
                                                              ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == FinishReason.LENGTH
    with pytest.raises(ValueError):
        llm.generate([list(range(5, 25))], GREEDY)  # prompt does not fit the context


def test_logprobs_are_raw_model_logprobs_like_hf(llm, hf_model):
    params = dataclasses.replace(GREEDY, max_tokens=6, logprobs=4, repetition_penalty=1.5)
    [out] = llm.generate([PROMPTS[0]], params)
    assert len(out.logprobs) == 6
    ids = torch.tensor([PROMPTS[0] + out.token_ids])
    with torch.inference_mode():
        raw = hf_model(ids).logits[0].log_softmax(-1)  # [L, V]
    for k, lp in enumerate(out.logprobs):
        row = raw[len(PROMPTS[0]) - 1 + k]
        assert lp.token_id == out.token_ids[k]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        top_v, top_i = row.topk(4)
        assert list(lp.top) == top_i.tolist()
        assert list(lp.top.values()) == pytest.approx(top_v.tolist(), abs=1e-4)


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "Hi there"}]
    [one] = llm.chat(messages, GREEDY)
    assert "<|im_start|>assistant" in one.prompt
    expected = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages),
                                    add_special_tokens=False)
    assert one.prompt_token_ids == expected
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "Yo"},
                                          {"role": "user", "content": "Again"}]], GREEDY)
    assert len(two) == 2 and two[0].token_ids == one.token_ids


def test_generate_command_streams_the_same_text(small_ckpt, llm, capsys):
    from services.cli import main

    rc = main(["generate", "--model", str(small_ckpt), "--prompt", "Hello there",
               "--max-tokens", "6", "--dtype", "float32", "--threads", "1", "--stats"])
    captured = capsys.readouterr()
    [ref] = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=6))
    assert rc == 0 and captured.out == ref.text + "\n"
    assert "6 generated" in captured.err
    assert main(["generate", "--model", "/nonexistent/model", "--prompt", "x"]) == 2
