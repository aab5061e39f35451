"""Hypothesis strategies for request bodies: real field names with arbitrary JSON values."""

from __future__ import annotations

from hypothesis import strategies as st

from tests.support.worker import MODEL

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "echo", "stop",
          "stream", "stream_options", "logprobs", "top_logprobs", "temperature", "top_p", "top_k",
          "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
          "min_tokens", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
          "return_token_ids", "tools", "tool_choice", "logit_bias", "response_format", "suffix",
          "add_generation_prompt", "user"]

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
           | st.text(st.characters(categories=["Cs", "Lo", "So", "Cc"]), max_size=4))  # surrogates too
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
# Values that look like the real thing, so parsing gets past the first field more often.
plausible = st.one_of(
    st.integers(min_value=-2, max_value=40), st.floats(min_value=-3, max_value=3), st.booleans(),
    st.sampled_from(["hi", "", MODEL, "auto", "none", "required"]),
    st.lists(st.integers(min_value=-5, max_value=300), max_size=5),
    st.just([{"role": "user", "content": "x"}]),
    st.just([{"type": "function", "function": {"name": "f"}}]),
    st.just({"include_usage": True}), st.just({"type": "text"}),
    st.just({"include_usage": True, "continuous_usage_stats": True}))
bodies = st.dictionaries(st.sampled_from(FIELDS), plausible | json_values, max_size=8)
