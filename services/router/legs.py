"""Request bodies for the two legs of a P/D request (pure functions over JSON dicts).

Pull: the prefill leg computes the prompt and exactly one token (`max_tokens=1`, no stream);
the decode leg gets the client's body unchanged plus the `kv_transfer_params` the prefill
returned, verbatim. Push: the router mints a `transfer_id` and both legs go out together, each
carrying the other side's coordinates from its metadata.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from services.router.workers import WorkerMetadata
from shared.protocol.pd import ApiKind, PrefillLegParams, PushDecodeParams, TransferMode

# Fields that would make the prefill leg stream or run past its single token.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, with the given kv_transfer_params."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in _PREFILL_DROPPED:
        out.pop(key, None)
    out["kv_transfer_params"] = kv_params
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's body plus the params (omitted when there are none)."""
    out = dict(body)  # shallow: the legs never mutate nested values
    if kv_params is not None:
        out["kv_transfer_params"] = kv_params
    return out


def pull_prefill_params() -> dict[str, Any]:
    return PrefillLegParams().to_wire()


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def push_params(transfer_id: str, prefill: WorkerMetadata) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill params, decode params) for one push-mode dispatch.

    The decode learns whom to register its pre-allocated blocks with (the prefill's engine and
    KV endpoint, from its metadata); the prefill writes into whichever decode registers the
    same `transfer_id`. Either may arrive first.
    """
    # WorkerMetadata.from_doc refuses a push prefill that reports no KV endpoint.
    assert prefill.kv_host is not None and prefill.kv_port is not None
    to_prefill = PrefillLegParams(TransferMode.PUSH, transfer_id)
    to_decode = PushDecodeParams(transfer_id, prefill.kv_host, prefill.kv_port, prefill.engine_id,
                                 prefill.kv_tls)
    return to_prefill.to_wire(), to_decode.to_wire()


def prompt_token_ids(body: dict[str, Any]) -> list[int] | None:
    """Token ids when a completions prompt is given as ids (single prompt only), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list)
            and all(isinstance(t, int) for t in prompt[0])):
        return prompt[0]
    return None


def can_stream_first_token_early(body: dict[str, Any]) -> bool:
    """Early first token is safe only if the decode's text is guaranteed to start with it.

    Stop strings can swallow text the prefill already released (a stop sequence spanning the
    first token), and `echo` puts the prompt before it; both fall back to a plain relay. So do
    chat requests offering tools (tool_choice other than "none"): the decode reads its output
    into tool calls (a parser, or the grammar of "required" / a named function), which may hold
    the first token back or make it part of a call. A worker that parses every chat request
    (a reasoning parser) says so in its prefill answer (`first_token.decode_parses`).
    """
    stop = body.get("stop")
    return not stop and not body.get("echo") and not _offers_tools(body)


def _offers_tools(body: dict[str, Any]) -> bool:
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


# Why a request is served whole on one worker (`needs_single_worker`); metric label values.
SINGLE_N = "n"
SINGLE_PROMPTS = "prompts"


def needs_single_worker(kind: ApiKind, body: dict[str, Any]) -> str | None:
    """Why a P/D leg cannot serve this request (it serves one prompt with n=1 and refuses the
    rest with `kv_one_choice`), or None when it can. Such requests go whole to one worker.

    Only well-formed values count: a malformed `n` or `prompt` stays on the usual route, where
    the worker's own 400 names the field. `best_of`, `echo`, `logprobs`, `top_logprobs` and
    `prompt_logprobs` are served (or refused) by the legs as by a mixed worker, so they stay on
    P/D.
    """
    n = body.get("n")
    if isinstance(n, int | float) and not isinstance(n, bool) and n > 1:
        return SINGLE_N
    prompt = body.get("prompt") if kind is ApiKind.COMPLETIONS else None
    if isinstance(prompt, list) and len(prompt) > 1 and (
            all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt)):
        return SINGLE_PROMPTS
    return None


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)
