"""A deterministic stand-in for AsyncEngine, to test the HTTP layer without a model.

Byte-level tokenizer (ids 0..255 are bytes, 256 is EOS, 257 BOS); each generated token is a
lowercase letter that depends only on the prompt and the position, so expected outputs are
computable in tests. Blocks are accounted like the real engine's (allocated as tokens grow,
freed when a request finishes or is aborted), so leak checks work through /v1/metadata.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from shared.config import EngineConfig
from shared.engine.outputs import FinishReason, RequestMetrics, RequestOutput, TokenLogprob
from shared.engine.sampling_params import SamplingParams
from shared.engine.stats import EngineStats

EOS, BOS = 256, 257


class FakeTokenizer:
    eos_token_ids = (EOS,)
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range")
            if i < 256:
                buf.append(i)
            elif not skip_special_tokens:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                out.append("<eos>" if i == EOS else "<bos>")
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def id_to_token(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Any = None, continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        text = f"<tools>{json.dumps(tools)}\n" if tools else ""
        text += "".join(f"<{k}={v}>" for k, v in sorted(kwargs.items()))  # template variables
        for m in messages:
            if "RAISE" in m["content"]:
                raise ValueError("template refused the conversation")
            text += f"<{m['role']}>{m['content']}\n"
        if continue_final_message:
            return text[:-1]  # the last message stays open: no newline after it
        return text + ("<assistant>" if add_generation_prompt else "")


def fake_token(prompt: Sequence[int], position: int, seed: int | None) -> int:
    """The i-th generated token: a lowercase letter fixed by the prompt, position and seed."""
    return ord("a") + (sum(prompt) + 7 * position + (seed or 0)) % 26


@dataclass
class FakeEngine:
    """Implements the AsyncEngine interface the worker uses.

    `step_delay` paces tokens; `gate`, when set, holds every request before its first token
    (admission and drain tests); a prompt containing b"FAIL" errors after two tokens.
    `script`, when set, is what every request generates instead of letters: its UTF-8 bytes,
    one token each, then EOS (a "model" that writes exactly a tool call or `<think>...`).
    """

    config: EngineConfig = field(default_factory=EngineConfig)
    max_model_len: int = 256
    step_delay: float = 0.001
    block_size: int = 4
    num_total_blocks: int = 512
    gate: asyncio.Event | None = None
    eos_at: int | None = None  # emit EOS at this position (unless ignore_eos)
    script: str | None = None  # generate exactly this text (byte tokens), then EOS
    engine_id: str = "fake-engine-0"
    fingerprint: str = "f" * 64
    model_dir: Path | None = None  # no checkpoint: no generation_config.json defaults
    healthy: bool = True
    failure: str | None = None
    started: bool = False
    blocks: dict[str, int] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    seen_params: list[SamplingParams] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_config = SimpleNamespace(vocab_size=FakeTokenizer.vocab_size)

    async def start(self) -> None:
        self.started = True

    def add_failure_listener(self, fn: Any) -> None:
        """The fake never fails as a whole (the real engine's failure path is tested with
        the real engine); the worker still subscribes."""

    async def shutdown(self) -> None:
        self.started = False

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def compile_grammar(self, spec: Any) -> None:
        """Structured output is the real engine's (tests/structured): the fake ignores it."""

    def stats(self) -> EngineStats:
        used = sum(self.blocks.values())
        return EngineStats(len(self.blocks), 0, self.num_total_blocks - used,
                           self.num_total_blocks, used / self.num_total_blocks, 0, 0, 0,
                           self.block_size, num_held_blocks=0)

    def _finish(self, params: SamplingParams, token: int, text: str, step: int) -> tuple[FinishReason | None, Any, str]:
        if step + 1 < params.min_tokens:
            return None, None, text
        if token in params.stop_token_ids or (token == EOS and not params.ignore_eos):
            return FinishReason.STOP, token if token != EOS else None, text
        for stop in params.stop:
            at = text.find(stop)
            if at >= 0:
                end = at + len(stop) if params.include_stop_str_in_output else at
                return FinishReason.STOP, stop, text[:end]
        if params.max_tokens is not None and step + 1 >= params.max_tokens:
            return FinishReason.LENGTH, None, text
        return None, None, text

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, kv: Any = None) -> AsyncIterator[RequestOutput]:
        assert kv is None, "the fake engine serves plain requests only"
        self.seen_params.append(params)
        metrics = RequestMetrics(arrival_time=time.monotonic())
        self.blocks[request_id] = -(-len(prompt_token_ids) // self.block_size)
        try:
            if self.gate is not None:
                await self.gate.wait()
            metrics.first_scheduled_time = time.monotonic()
            tokens: list[int] = []
            text = ""
            for step in range(10**6):
                await asyncio.sleep(self.step_delay)
                if request_id in self.aborted:
                    yield self._output(request_id, prompt_token_ids, tokens, [], "", text, None,
                                       FinishReason.ABORT, None, metrics)
                    return
                if b"FAIL" in bytes(t for t in prompt_token_ids if t < 256) and step == 2:
                    out = self._output(request_id, prompt_token_ids, tokens, [], "", text, None,
                                       FinishReason.ERROR, None, metrics)
                    out.error = "injected engine failure"
                    yield out
                    return
                token = self._next_token(prompt_token_ids, step, params.seed)
                tokens = [*tokens, token]
                self.blocks[request_id] = -(-(len(prompt_token_ids) + len(tokens)) // self.block_size)
                # As the real engine: the EOS that stops a request adds no text.
                stops = token == EOS and not (params.ignore_eos or params.include_stop_str_in_output)
                full = text + ("" if stops else self.tokenizer.decode([token],
                                                                      params.skip_special_tokens))
                reason, stop_reason, full = self._finish(params, token, full, step)
                now = time.monotonic()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                lps = self._logprobs(token, params.logprobs)
                yield self._output(request_id, prompt_token_ids, tokens, [token], full[len(text):],
                                   full, lps, reason, stop_reason, metrics)
                text = full
                if reason is not None:
                    return
        finally:
            self.blocks.pop(request_id, None)

    def _next_token(self, prompt: list[int], step: int, seed: int | None) -> int:
        if self.script is not None:
            scripted = self.script.encode("utf-8")
            return scripted[step] if step < len(scripted) else EOS
        return EOS if self.eos_at == step else fake_token(prompt, step, seed)

    @staticmethod
    def _logprobs(token: int, top_n: int | None) -> list[TokenLogprob] | None:
        if top_n is None:
            return None
        top = {token: -0.25}
        for k in range(1, top_n):
            top[ord("A") + k] = -1.0 - k
        return [TokenLogprob(token_id=token, logprob=-0.25, top=dict(list(top.items())[:top_n]))]

    @staticmethod
    def _output(rid: str, prompt: list[int], tokens: list[int], new_ids: list[int], new_text: str,
                text: str, logprobs: list[TokenLogprob] | None, reason: FinishReason | None,
                stop_reason: Any, metrics: RequestMetrics) -> RequestOutput:
        if reason is not None:
            metrics.finished_time = time.monotonic()
        return RequestOutput(request_id=rid, prompt_token_ids=prompt, new_token_ids=new_ids,
                             new_text=new_text, token_ids=tokens, text=text, finished=reason is not None,
                             finish_reason=reason, stop_reason=stop_reason, new_logprobs=logprobs,
                             metrics=metrics)


def fake_completion_text(prompt_ids: Sequence[int], n_tokens: int, seed: int | None = None) -> str:
    """What FakeEngine generates for `prompt_ids` with no stop condition before n_tokens."""
    return "".join(chr(fake_token(prompt_ids, i, seed)) for i in range(n_tokens))
