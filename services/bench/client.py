"""One streamed OpenAI request -> one RequestRecord, with the timings vLLM's benchmark takes.

Timing definitions (all from the moment the request is sent):
- TTFT: the first SSE chunk that carries non-empty text (`choices[0].text` or
  `choices[0].delta.content`). vLLM takes the first chunk with any `choices`; an empty role
  chunk a server may send before prefill would make that a network round trip, not a TTFT.
- ITL: the gaps between successive text-carrying chunks (a chunk may hold several tokens).
- E2EL: until the stream ends (`data: [DONE]` or EOF).
- Output tokens: `usage.completion_tokens` of the include_usage chunk, else the text chunks.
pdmesh's router adds per-phase timings in the `x-pdmesh-phases` header (sent with the first
bytes, so only the phases done by then) and under a `pdmesh` key of the usage chunk (all of
them); both are merged, the chunk winning. See parse_pdmesh_info for the accepted spellings.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeGuard

import aiohttp

from services.bench.config import BenchConfig
from services.bench.datasets import Prompt
from shared.protocol.pd import PHASES_HEADER, ApiKind

NON_PHASE_KEYS = ("kv_bytes", "disagg_decision", "decision", "retries", "attempts", "total")


class RequestStatus(Enum):
    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"  # in flight when the run was interrupted


@dataclass(frozen=True)
class PdmeshInfo:
    """What pdmesh's router reports about one request: phase -> seconds, and counters."""

    phases: dict[str, float] = field(default_factory=dict)
    kv_bytes: int | None = None
    disagg_decision: str | None = None
    retries: int | None = None


@dataclass(frozen=True)
class RequestRecord:
    """The timings and outcome of one request. Seconds throughout; start_s is run-relative."""

    index: int
    status: RequestStatus
    start_s: float
    prompt_len: int | None  # usage.prompt_tokens when reported, else the dataset's count
    output_len_requested: int
    output_tokens: int = 0
    output_tokens_source: str = "chunks"  # "usage" | "chunks"
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: tuple[float, ...] = ()
    http_status: int | None = None
    error_type: str | None = None
    error: str | None = None
    pdmesh: PdmeshInfo = field(default_factory=PdmeshInfo)


@dataclass
class _Stream:
    """Accumulator while one stream is read (internal, mutable)."""

    sent: float
    first: float | None = None
    last_text: float | None = None
    end: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    usage_completion: int | None = None
    usage_prompt: int | None = None
    info: dict[str, object] = field(default_factory=dict)
    error_type: str | None = None
    error: str | None = None


def parse_pdmesh_info(raw: dict[str, object]) -> PdmeshInfo:
    """Phase durations and counters from the router's document, in either spelling:

    - `name_ms: 12.5` (pdmesh's router: milliseconds) or `name: 0.0125` / `name_s` (seconds);
    - `decision` or `disagg_decision`; `retries`, else `attempts - 1` (the router counts
      attempts); `kv_bytes`. `total` is the whole request, not a phase, and is left out.
    Strings other than the decision (worker ids) and nulls (not measured yet) are ignored.
    """
    phases: dict[str, float] = {}
    for key, value in raw.items():
        if key not in NON_PHASE_KEYS and _is_number(value):
            name, scale = (key[:-3], 1e-3) if key.endswith("_ms") else (
                (key[:-2], 1.0) if key.endswith("_s") else (key, 1.0))
            if name not in NON_PHASE_KEYS:
                phases[name] = float(value) * scale
    decision = raw.get("disagg_decision", raw.get("decision"))
    retries = raw.get("retries")
    attempts = raw.get("attempts")
    if not _is_number(retries) and _is_number(attempts):
        retries = max(int(attempts) - 1, 0)
    kv = raw.get("kv_bytes")
    return PdmeshInfo(phases, int(kv) if _is_number(kv) else None,
                      str(decision) if decision is not None else None,
                      int(retries) if _is_number(retries) else None)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


async def iter_sse(content: aiohttp.StreamReader) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, data) per SSE event; comments (`: ping`) and other fields are skipped."""
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield time.perf_counter(), "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield time.perf_counter(), "\n".join(data)


def build_payload(config: BenchConfig, prompt: Prompt) -> dict[str, object]:
    body: dict[str, object] = {"model": config.model, "stream": True, "temperature": 0.0,
                               "stream_options": {"include_usage": True}}
    if config.endpoint is ApiKind.CHAT:
        assert isinstance(prompt.prompt, str), "datasets give chat text prompts"
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
        # Both spellings: vLLM and pdmesh read max_completion_tokens, older servers max_tokens.
        body["max_completion_tokens"] = prompt.output_len
    else:
        body["prompt"] = prompt.prompt
    body["max_tokens"] = prompt.output_len
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


class OpenAIClient:
    """Sends streamed requests through one shared aiohttp session and times them."""

    def __init__(self, session: aiohttp.ClientSession, config: BenchConfig) -> None:
        self._session = session
        self._config = config
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._chat = config.endpoint is ApiKind.CHAT

    async def send(self, index: int, prompt: Prompt, run_start: float) -> RequestRecord:
        st = _Stream(sent=time.perf_counter())
        status: int | None = None
        try:
            async with self._session.post(self._config.url, json=build_payload(self._config, prompt),
                                          headers=self._headers) as resp:
                status = resp.status
                if status != 200:
                    st.error_type, st.error = _http_error(status, await resp.text())
                else:
                    _merge_header_info(st, resp.headers.get(PHASES_HEADER))
                    await self._read(resp.content, st)
        except asyncio.CancelledError:
            # A leaf task: the runner cancels it on SIGINT and collects this record.
            return RequestRecord(index, RequestStatus.CANCELLED, st.sent - run_start,
                                 prompt.prompt_len, prompt.output_len, http_status=status)
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError) as exc:
            st.error_type = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
            st.error = str(exc) or st.error_type
        return _finish(index, prompt, st, status, run_start)

    async def _read(self, content: aiohttp.StreamReader, st: _Stream) -> None:
        async for ts, data in iter_sse(content):
            st.end = ts
            if data.startswith("[DONE]"):
                return
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                st.error_type, st.error = "bad_sse_json", data[:200]
                return
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                err = obj["error"]
                kind = err.get("type") if isinstance(err, dict) else None
                st.error_type = f"stream:{kind or 'error'}"
                st.error = json.dumps(err)[:500]
                return
            self._on_chunk(ts, obj, st)

    def _on_chunk(self, ts: float, obj: dict[str, Any], st: _Stream) -> None:
        text = _chunk_text(obj, self._chat)
        if text:
            if st.first is None:
                st.first = ts
            else:
                assert st.last_text is not None  # set together with st.first
                st.itl.append(ts - st.last_text)
            st.last_text = ts
            st.chunks += 1
        usage = obj.get("usage")
        if isinstance(usage, dict):
            st.usage_completion = _int_or_none(usage.get("completion_tokens"))
            st.usage_prompt = _int_or_none(usage.get("prompt_tokens"))
            if isinstance(usage.get("pdmesh"), dict):
                st.info.update(usage["pdmesh"])
        if isinstance(obj.get("pdmesh"), dict):
            st.info.update(obj["pdmesh"])


def _chunk_text(obj: dict[str, Any], chat: bool) -> str | None:
    """The generated text of choice 0 in one chunk (chat: content or reasoning_content)."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    if not chat:
        return choices[0].get("text")
    delta = choices[0].get("delta")
    if not isinstance(delta, dict):
        return None
    return delta.get("content") or delta.get("reasoning_content")


def _int_or_none(value: object) -> int | None:
    return int(value) if _is_number(value) else None


def _merge_header_info(st: _Stream, header: str | None) -> None:
    if not header:
        return
    try:
        raw = json.loads(header)
    except json.JSONDecodeError:
        return  # a malformed header loses the breakdown, not the request
    if isinstance(raw, dict):
        st.info.update(raw)


def _http_error(status: int, body: str) -> tuple[str, str]:
    """`http_503:ServiceUnavailableError` from the OpenAI envelope when there is one."""
    kind = None
    try:
        err = json.loads(body).get("error")
        kind = err.get("type") if isinstance(err, dict) else None
    except (json.JSONDecodeError, AttributeError):
        pass
    return (f"http_{status}:{kind}" if kind else f"http_{status}"), body[:500]


def _finish(index: int, prompt: Prompt, st: _Stream, status: int | None,
            run_start: float) -> RequestRecord:
    if st.error_type is None and st.first is None:
        st.error_type, st.error = "empty_stream", "no chunk carried any text"
    ok = st.error_type is None
    tokens, source = (st.usage_completion, "usage") if st.usage_completion is not None \
        else (st.chunks, "chunks")
    ttft_s: float | None = None
    e2el_s: float | None = None
    if ok:
        # ok: a text chunk arrived, which set st.first and st.last_text.
        assert st.first is not None and st.last_text is not None
        ttft_s = st.first - st.sent
        e2el_s = (st.end or st.last_text) - st.sent
    return RequestRecord(
        index=index,
        status=RequestStatus.OK if ok else RequestStatus.FAILED,
        start_s=st.sent - run_start,
        prompt_len=st.usage_prompt if st.usage_prompt is not None else prompt.prompt_len,
        output_len_requested=prompt.output_len,
        output_tokens=tokens if ok else 0,
        output_tokens_source=source,
        ttft_s=ttft_s,
        e2el_s=e2el_s,
        itl_s=tuple(st.itl) if ok else (),
        http_status=status,
        error_type=st.error_type,
        error=st.error,
        pdmesh=parse_pdmesh_info(st.info),
    )
