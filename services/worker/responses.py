"""Response bodies and stream chunks of /v1/completions and /v1/chat/completions.

Non-streaming bodies are built from the final `ChoiceState`s. Streaming follows OpenAI and
vLLM: per choice, a first chunk (chat: `delta: {"role": "assistant", "content": ""}`;
completions with echo: the prompt text), content chunks, then a chunk with an empty delta and
the `finish_reason`; every chunk carries `"usage": null`, and with `include_usage` one last
chunk has `"choices": []` and the totals. With `include_usage` and `continuous_usage_stats`
(services/common/stream_usage.py) every chunk with choices carries the counts so far instead:
the request's prompt tokens and the tokens its choices generated up to that chunk; a role
chunk counts none of the output it precedes (completion_tokens 0 on the first, as vLLM).

A chat request whose output is parsed (`ChatOutputPlan.active`: tool calls, reasoning) has each
choice read by a `ParsedChoice`: its deltas become the chunks' `delta` fields, their join the
full body's `message`, and `usage.completion_tokens_details.reasoning_tokens` is reported when a
reasoning parser is configured. Otherwise the text goes out verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.stream_usage import StreamUsage, TokenCounts
from services.worker.chat_output import ChatOutputPlan
from services.worker.generation import ChoiceState, PreparedPrompt
from services.worker.logprobs import LogprobFormatter
from services.worker.parsed_choice import ParsedChoice, delta_fields
from shared.engine.outputs import RequestOutput
from shared.protocol.pd import ApiKind


@dataclass(frozen=True)
class ResponseSpec:
    """What shapes one response: endpoint, ids, and the options that change the body."""

    kind: ApiKind
    response_id: str
    created: int
    model: str
    system_fingerprint: str
    prompts: list[PreparedPrompt]
    logprobs: int | None = None  # top-N to report; None: no logprobs
    echo: bool = False
    return_token_ids: bool = False
    stream_usage: StreamUsage = StreamUsage()


class ResponseBuilder:
    """Builds the JSON-ready dicts of one response (full body or stream chunks).

    `chat` is how a chat request's output is read; None (or not active): verbatim text.
    """

    def __init__(self, spec: ResponseSpec, formatter: LogprobFormatter,
                 chat: ChatOutputPlan | None = None) -> None:
        self.spec = spec
        self.fmt = formatter
        self._full_object, self._chunk_object = spec.kind.response_object, spec.kind.chunk_object
        self.chat = chat if chat is not None and chat.active else None
        self._parsed: dict[int, ParsedChoice] = {}
        self._num_prompt_tokens = sum(len(p.token_ids) for p in spec.prompts)
        # Streaming: tokens generated so far, per choice index and in all (continuous usage).
        self._num_generated: dict[int, int] = {}
        self._num_completion_tokens = 0

    def parsed(self, state: ChoiceState) -> ParsedChoice | None:
        """The choice's parsing state (None when the output is not parsed)."""
        if self.chat is None:
            return None
        parsed = self._parsed.get(state.job.index)
        if parsed is None:
            parsed = self._parsed[state.job.index] = ParsedChoice(self.chat)
        return parsed

    def observe(self, state: ChoiceState, out: RequestOutput) -> None:
        """Non-streamed: feed the output to the choice's parser as it arrives (so reasoning
        tokens are counted per output, as when streaming)."""
        parsed = self.parsed(state)
        if parsed is not None:
            parsed.feed(out)

    def _envelope(self, obj: str, choices: list[dict[str, Any]],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.spec.response_id, "object": obj, "created": self.spec.created,
                "model": self.spec.model, "system_fingerprint": self.spec.system_fingerprint,
                "choices": choices, "usage": usage}

    def usage(self, states: list[ChoiceState]) -> dict[str, Any]:
        completion = sum(len(s.token_ids) for s in states)
        usage = TokenCounts(self._num_prompt_tokens, completion).usage()
        if self.chat is not None and self.chat.reasoning is not None:  # as vLLM: only then
            reasoning = sum(p.reasoning_tokens for s in states if (p := self.parsed(s)))
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def _logprobs(self, state: ChoiceState, entries: list[Any]) -> dict[str, Any] | None:
        top_n = self.spec.logprobs
        if top_n is None:
            return None
        if self.spec.kind is ApiKind.CHAT:
            return self.fmt.chat(entries, top_n)
        body, state.text_offset = self.fmt.completion(entries, top_n, state.text_offset)
        return body

    def _add_token_ids(self, choice: dict[str, Any], state: ChoiceState, token_ids: list[int],
                       with_prompt: bool) -> None:
        if self.spec.return_token_ids:
            if with_prompt:
                choice["prompt_token_ids"] = self.spec.prompts[state.job.prompt_index].token_ids
            choice["token_ids"] = token_ids

    def full_body(self, states: list[ChoiceState]) -> dict[str, Any]:
        choices = []
        for state in sorted(states, key=lambda s: s.job.index):
            prompt = self.spec.prompts[state.job.prompt_index]
            if self.spec.echo:
                state.text_offset = len(prompt.text)
            logprobs = self._logprobs(state, state.logprobs)
            choice: dict[str, Any] = {"index": state.job.index}
            parsed = self.parsed(state)
            if parsed is not None:
                choice["message"] = parsed.message()
            elif self.spec.kind is ApiKind.CHAT:
                choice["message"] = {"role": "assistant", "content": state.text}
            else:
                choice["text"] = (prompt.text if self.spec.echo else "") + state.text
            finish = parsed.finish_reason(state.finish_reason) if parsed else state.finish_reason
            choice.update(logprobs=logprobs, finish_reason=finish, stop_reason=state.stop_reason)
            self._add_token_ids(choice, state, state.token_ids, with_prompt=True)
            choices.append(choice)
        return self._envelope(self._full_object, choices, self.usage(states))

    def _chunk(self, choice: dict[str, Any], counts: TokenCounts) -> dict[str, Any]:
        """A chunk of one choice; `counts` are the request's so far, reported with continuous
        usage only."""
        usage = counts.usage() if self.spec.stream_usage.continuous else None
        return self._envelope(self._chunk_object, [choice], usage)

    def _count(self, state: ChoiceState) -> tuple[TokenCounts, TokenCounts]:
        """The request's counts before and after the choice's newest output (`state` has taken
        it in): a role chunk reports the former, the chunks showing the output the latter."""
        before = TokenCounts(self._num_prompt_tokens, self._num_completion_tokens)
        index = state.job.index
        self._num_completion_tokens += len(state.token_ids) - self._num_generated.get(index, 0)
        self._num_generated[index] = len(state.token_ids)
        return before, TokenCounts(self._num_prompt_tokens, self._num_completion_tokens)

    def _delta_choice(self, state: ChoiceState, text: str | dict[str, Any], logprobs: Any,
                      finish: str | None) -> dict[str, Any]:
        """`text`: the new text, or (parsed chat) the delta's fields."""
        choice: dict[str, Any] = {"index": state.job.index}
        if isinstance(text, dict):
            choice["delta"] = text or ({"content": ""} if finish is None else {})
        elif self.spec.kind is ApiKind.CHAT:
            choice["delta"] = {"content": text} if text or finish is None else {}
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=finish)
        if finish is not None:
            choice["stop_reason"] = state.stop_reason
        return choice

    def chunks_for(self, state: ChoiceState, out: RequestOutput) -> list[dict[str, Any]]:
        """The chunks one engine output turns into (none when it carries nothing to show)."""
        chunks = []
        before, counts = self._count(state)
        text, first = out.new_text, not state.started
        if first:
            state.started = True
            if self.spec.kind is ApiKind.CHAT:
                role = {"index": state.job.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}
                self._add_token_ids(role, state, [], with_prompt=True)
                chunks.append(self._chunk(role, before))
                first = False
            elif self.spec.echo:
                text = self.spec.prompts[state.job.prompt_index].text + text
                state.text_offset = len(text) - len(out.new_text)
        parsed = self.parsed(state)
        payload: str | dict[str, Any] = delta_fields(parsed.feed(out)) if parsed else text
        wants_tokens = self.spec.logprobs is not None or self.spec.return_token_ids
        ids_first = first and self.spec.return_token_ids
        if payload or (out.new_token_ids and wants_tokens) or ids_first:
            logprobs = self._logprobs(state, out.new_logprobs or [])
            choice = self._delta_choice(state, payload, logprobs, None)
            self._add_token_ids(choice, state, out.new_token_ids, with_prompt=first)
            chunks.append(self._chunk(choice, counts))
        if out.finished:
            finish = parsed.finish_reason(state.finish_reason) if parsed else state.finish_reason
            chunks.append(self._chunk(self._delta_choice(state, "", None, finish), counts))
        return chunks

    def usage_chunk(self, states: list[ChoiceState]) -> dict[str, Any]:
        return self._envelope(self._chunk_object, [], self.usage(states))
