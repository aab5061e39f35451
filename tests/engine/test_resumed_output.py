"""A resumed sequence (SamplingParams.resumed_token_ids, what a migrated request runs with)
continues exactly where the uninterrupted one was: for every cut point, the ids and text
streamed before the cut plus the resumed run's equal the uninterrupted run's, token for token
and character for character: held-back partial characters and stop-string prefixes included
(random weights with SmolLM2's byte-level vocabulary emit many multi-byte pieces)."""

from __future__ import annotations

import dataclasses

from shared.engine.sampling_params import SamplingParams
from tests.support.engine import assert_all_blocks_free, random_prompts

PROMPTS = random_prompts([9, 23], seed=11)
N = 20


def _stream(engine, prompt: list[int], params: SamplingParams) -> list[tuple[list[int], str]]:
    """(ids so far, text so far) after each output of one request, run alone."""
    engine.add_request("r", prompt, params)
    cuts, text = [], ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.new_text
            cuts.append((list(out.token_ids), text))
            if out.finished:
                assert text == out.text
    return cuts


def _check_resumes(engine, prompt: list[int], params: SamplingParams) -> int:
    full = _stream(engine, prompt, params)
    ids, text = full[-1]
    for done_ids, done_text in full[:-1]:
        resumed = dataclasses.replace(params, max_tokens=params.max_tokens - len(done_ids),
                                      resumed_token_ids=tuple(done_ids))
        rest = _stream(engine, prompt + done_ids, resumed)
        rest_ids, rest_text = rest[-1]
        assert done_ids + rest_ids == ids, len(done_ids)
        assert done_text + rest_text == text, (len(done_ids), done_text, rest_text)
    assert_all_blocks_free(engine)
    return len(ids)


def test_greedy_and_seeded_resumes_equal_the_uninterrupted_output(make_engine):
    engine = make_engine()
    for prompt in PROMPTS:
        for params in (SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
                       SamplingParams(temperature=0.9, seed=7, max_tokens=N, ignore_eos=True)):
            assert _check_resumes(engine, prompt, params) == N


def _spanning_stop(cuts: list[tuple[list[int], str]]) -> str:
    """A 2-character stop string made of the last character of one output's text and the first
    of the next one's, found nowhere earlier: it spans that token boundary."""
    texts = [text for _, text in cuts]
    for i in range(2, len(texts) - 2):
        before, cut, after = texts[i - 1], texts[i], texts[i + 1]
        if len(cut) > len(before) and len(after) > len(cut):
            stop = cut[-1] + after[len(cut)]
            if stop.strip() and texts[-1].find(stop) == len(cut) - 1:
                return stop
    raise AssertionError(f"no token boundary to span in {texts[-1]!r}")


def test_a_stop_string_spanning_the_cut_still_stops_the_resumed_run(make_engine):
    """The first character of the stop string is held back at the cut: a resumed run that did
    not replay the earlier output would lose it and never match the stop."""
    engine = make_engine()
    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    stop = _spanning_stop(_stream(engine, PROMPTS[0], greedy))
    stopped = dataclasses.replace(greedy, stop=(stop,))
    made = _check_resumes(engine, PROMPTS[0], stopped)
    assert made < N  # the stop string did end it early, in every resumed run as well
