"""Stop conditions, detokenisation and RequestOutput building, once per new token.

Stop conditions, in the order they win when several hold for the same token:
1. a stop token: EOS (unless ignore_eos) or one of stop_token_ids -> STOP. Checked only once
   min_tokens outputs exist (the sampler also bans those ids before that). The stop token
   stays in token_ids; its text is left out unless include_stop_str_in_output.
2. a stop string in the detokenised text -> STOP; the text is cut before it (or after it
   with include_stop_str_in_output); stop_reason is the string.
3. a structured-output grammar that is complete after this token -> STOP (its text is kept;
   min_tokens does not hold it back); a token outside the grammar -> ERROR.
4. max_tokens outputs, or the context length (max_model_len) reached -> LENGTH.
Text is streamed append-only by the tokenizer helper's IncrementalDetokenizer (it holds
back partial UTF-8 characters and possible stop-string prefixes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.engine.outputs import RequestOutput
from shared.engine.request import Request, RequestStatus
from shared.engine.structured import GrammarPhase
from shared.model.detokenizer import IncrementalDetokenizer
from shared.model.tokenizer import Tokenizer


@dataclass
class _Stream:
    detok: IncrementalDetokenizer
    num_sent: int = 0  # output tokens already emitted in a RequestOutput
    resumed_chars: int = 0  # text of params.resumed_token_ids: emitted by an earlier worker


class OutputProcessor:
    """Per-request streaming state; lives on the engine thread next to the scheduler."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._streams: dict[str, _Stream] = {}

    def add_request(self, request: Request) -> None:
        p = request.params
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output)
        # A resumed sequence replays its earlier output: the detokenizer then holds exactly
        # what the earlier worker's held (a partial character, a possible stop prefix).
        detok.add(p.resumed_token_ids)
        self._streams[request.request_id] = _Stream(detok, resumed_chars=len(detok.text))

    def remove(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def process(self, request: Request) -> RequestOutput:
        """Consume the request's tokens appended since the last call (usually one).

        Sets request.status to FINISHED_* (and stop_reason) when a stop condition holds; the
        caller then tells the scheduler to free it.
        """
        stream = self._streams[request.request_id]
        new_ids = request.output_token_ids[stream.num_sent:]
        pieces = []
        for i, token in enumerate(new_ids):
            status = self._check_token(request, token, stream.num_sent + i + 1)
            if status is None or request.params.include_stop_str_in_output:
                delta = stream.detok.add(token)
                pieces.append(delta.text)
                if status is None and delta.stop_str is not None:
                    status, request.stop_reason = RequestStatus.FINISHED_STOPPED, delta.stop_str
            if status is None and request.structured is not None:
                status = _grammar_status(request)
            if status is None and self._at_length(request, stream.num_sent + i + 1):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                request.status = status
                new_ids = new_ids[:i + 1]  # tokens after a stop are dropped
                request.truncate_output(stream.num_sent + i + 1)
                break
        if request.is_finished:
            pieces.append(stream.detok.finish().text)
        stream.num_sent += len(new_ids)
        now = time.monotonic()
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        return self._output(request, stream, new_ids, "".join(pieces))

    def _check_token(self, request: Request, token: int, num_output: int) -> RequestStatus | None:
        p = request.params
        if num_output < p.min_tokens:
            return None
        if not p.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def _at_length(self, request: Request, num_output: int) -> bool:
        max_tokens = request.params.max_tokens
        return ((max_tokens is not None and num_output >= max_tokens)
                or request.num_prompt_tokens + num_output >= self.max_model_len)

    def finish(self, request: Request) -> RequestOutput:
        """Final output of a request ended from outside (abort, error): no new tokens."""
        stream = self._streams.get(request.request_id)
        text = stream.detok.finish().text if stream else ""
        return self._output(request, stream, [], text)

    def _output(self, request: Request, stream: _Stream | None, new_ids: list[int],
                new_text: str) -> RequestOutput:
        finished = request.is_finished
        if finished:
            request.metrics.finished_time = time.monotonic()
            self.remove(request.request_id)
        logprobs = request.pending_logprobs
        if logprobs:
            request.pending_logprobs = []
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            new_token_ids=list(new_ids),
            new_text=new_text,
            token_ids=list(request.output_token_ids),
            text=stream.detok.text[stream.resumed_chars:] if stream else "",
            finished=finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            new_logprobs=logprobs[:len(new_ids)] if request.params.logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request.metrics,
            error=request.error,
        )


def _grammar_status(request: Request) -> RequestStatus | None:
    state = request.structured
    assert state is not None
    if state.phase is GrammarPhase.FINISHED:
        return RequestStatus.FINISHED_STOPPED
    if state.phase is GrammarPhase.FAILED:
        request.error = state.error
        return RequestStatus.FINISHED_ERROR
    return None
