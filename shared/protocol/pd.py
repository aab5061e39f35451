"""The P/D contract between router and workers, defined once: roles, endpoint kinds, header
names, and the `kv_transfer_params` each leg carries.

Shapes of `kv_transfer_params` (vLLM's routing flags, pdmesh's fields):
- router -> prefill (`PrefillLegParams`): pull `{"do_remote_decode": true, "do_remote_prefill":
  false}`; push adds `"transfer_id"`, `"transfer_mode": "push"` (optionally the expected
  `"decode_engine_id"`).
- prefill -> router -> decode, pull (`KVTransferParams`): the prefill's lease on the prompt's
  KV, passed on verbatim by the router; it carries `"do_remote_prefill": true`.
- router -> decode, push (`PushDecodeParams`): `"transfer_id"`, the prefill's KV address
  `"remote_host"`/`"remote_port"` and `"remote_engine_id"`, `"do_remote_prefill": true`.
- Both addresses (pull and push) carry `"remote_tls": true` when the prefill's KV listener
  serves TLS (the field is left out otherwise, so plain-HTTP peers see the wire they know).
- push prefill -> router (`PushPrefillResult`): what the push moved (for the client's report).

Versioning: `PD_VERSION` is the contract's version. The dataclasses do not write it (the wire
stays what routers and workers of version 1 exchange); `from_wire` accepts an optional
`"pd_version"` field and refuses one newer than its own. This module imports only the
standard library and shared.protocol.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from shared.protocol.codec import Message, ProtocolError, from_fields, to_fields
from shared.protocol.messages import TRANSFER_MODES, TokenLogprobWire, kv_address

PD_VERSION = 1
VERSION_FIELD = "pd_version"
PARAM = "kv_transfer_params"  # the request/response field that carries the contract
ROUTING_FLAGS = frozenset({"do_remote_prefill", "do_remote_decode"})  # vLLM-style hints
PHASES_HEADER = "x-pdmesh-phases"  # per-phase timings (decode -> router -> client)
# Prefill -> router, top level of a chat prefill leg's answer: `true` when the workers parse
# this request's output (tool calls, reasoning), so the raw first token must not be streamed
# ahead of the decode: the decode may hold it back or turn it into reasoning or a call.
OUTPUT_PARSED_FIELD = "output_parsed"
# Router -> worker, top level of a request body: the output token ids a failed decode already
# streamed for this request (request migration, services/router/migration.py). The worker
# appends them to the prompt and continues the text where theirs ended; the router sends
# max_tokens / min_tokens reduced by their number. One prompt, n=1, no KV leg.
RESUME_FIELD = "pdmesh_resume_token_ids"


class Role(StrEnum):
    """What part of a request a worker serves. Prefill and decode workers run a KV-transfer
    service next to the API; every role still serves plain requests on its own."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class TransferMode(StrEnum):
    """How prompt KV moves: the decode pulls leased blocks, or the prefill pushes them."""

    PULL = "pull"
    PUSH = "push"


class ApiKind(StrEnum):
    """Which OpenAI endpoint a request came in on; decides paths and response shapes."""

    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is ApiKind.COMPLETIONS else "/v1/chat/completions"

    @property
    def response_object(self) -> str:
        return "text_completion" if self is ApiKind.COMPLETIONS else "chat.completion"

    @property
    def chunk_object(self) -> str:
        return "text_completion" if self is ApiKind.COMPLETIONS else "chat.completion.chunk"

    @classmethod
    def from_path(cls, path: str) -> ApiKind:
        for kind in cls:
            if kind.path == path:
                return kind
        raise ValueError(f"not an OpenAI generation path: {path!r}")


def _fields(data: object, known: frozenset[str]) -> dict[str, Any]:
    """`data` as a dict without the routing flags and version; ProtocolError on anything
    malformed (not an object, a newer version, an unknown field)."""
    if not isinstance(data, Mapping):
        raise ProtocolError(f"{PARAM} must be an object")
    version = data.get(VERSION_FIELD, PD_VERSION)
    if not isinstance(version, int) or not 1 <= version <= PD_VERSION:
        raise ProtocolError(f"{PARAM}.{VERSION_FIELD} {version!r} is not supported "
                            f"(this side speaks 1..{PD_VERSION})")
    fields = {k: v for k, v in data.items() if k not in ROUTING_FLAGS and k != VERSION_FIELD}
    unknown = set(fields) - known
    if unknown:
        raise ProtocolError(f"unknown {PARAM} fields {sorted(unknown)}")
    return fields


@dataclass(frozen=True)
class PrefillLegParams:
    """Router -> prefill: compute the prompt and its first token, then hand the KV off.

    `transfer_id` is the push rendezvous id (None: pull, the KV is leased and described in
    the response); `decode_engine_id`, when given, is the only decode allowed to register.
    """

    mode: TransferMode = TransferMode.PULL
    transfer_id: str | None = None
    decode_engine_id: str | None = None

    def __post_init__(self) -> None:
        if (self.mode is TransferMode.PUSH) != (self.transfer_id is not None):
            raise ValueError("push mode needs a transfer_id, pull mode takes none")

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.transfer_id is not None:
            out = {"transfer_id": self.transfer_id, "transfer_mode": self.mode.value}
        if self.decode_engine_id is not None:
            out["decode_engine_id"] = self.decode_engine_id
        return {**out, "do_remote_decode": True, "do_remote_prefill": False}

    @staticmethod
    def from_wire(data: object) -> PrefillLegParams:
        f = _fields(data, frozenset({"transfer_id", "transfer_mode", "decode_engine_id"}))
        transfer_id = f.get("transfer_id")
        mode = f.get("transfer_mode", "push" if transfer_id else "pull")
        try:
            return PrefillLegParams(TransferMode(mode), transfer_id, f.get("decode_engine_id"))
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None


@dataclass(frozen=True)
class KVTransferParams(Message, tag="kv_params"):
    """Prefill -> router -> decode, pull: where the prompt's KV is leased and how to check it.

    `lease_expiry` is wall-clock (time.time()) because it crosses hosts; `digests[i]` is the
    digest of block `block_ids[i]` (see shared.protocol.tensors.block_digest).
    `prompt_digest` (`prompt_digest()` of the prompt's token ids; empty: not given) lets the
    decode check that the KV belongs to the prompt it was sent, not just to one as long.
    `remote_tls`: the prefill's KV listener serves TLS (the decode pulls over https).
    """

    transfer_mode: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    lease_id: str
    block_ids: list[int]
    num_tokens: int
    block_size: int
    first_token: TokenLogprobWire
    lease_expiry: float
    digests: list[str]
    compat_hash: str
    prompt_digest: str = ""
    remote_tls: bool = False

    def __post_init__(self) -> None:
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"unknown transfer_mode {self.transfer_mode!r}")
        if self.num_tokens < 1 or self.block_size < 1:
            raise ValueError("num_tokens and block_size must be >= 1")
        if len(self.block_ids) != math.ceil(self.num_tokens / self.block_size):
            raise ValueError(f"{len(self.block_ids)} block ids for {self.num_tokens} tokens "
                             f"at block size {self.block_size}")
        if len(self.digests) != len(self.block_ids):
            raise ValueError("one digest per block is required")

    @property
    def remote_address(self) -> str:
        return kv_address(self.remote_host, self.remote_port, self.remote_tls)

    def to_wire(self) -> dict[str, Any]:
        """The object a pull prefill returns, with vLLM's routing flags for the router."""
        return {**_without_plain(to_fields(self)), "do_remote_prefill": True,
                "do_remote_decode": False}

    @staticmethod
    def from_wire(data: object) -> KVTransferParams:
        return from_fields(KVTransferParams, _fields(data, _PULL_FIELDS))


_PULL_FIELDS = frozenset(f.name for f in dataclasses.fields(KVTransferParams))


def _without_plain(fields: dict[str, Any]) -> dict[str, Any]:
    """`remote_tls` only when true: a plain-HTTP peer's wire stays what it was."""
    if not fields.get("remote_tls"):
        fields.pop("remote_tls", None)
    return fields


@dataclass(frozen=True)
class PushDecodeParams:
    """Router -> decode, push: continue a request whose prompt KV the prefill at
    `remote_host:remote_port` (engine `remote_engine_id`; TLS when `remote_tls`) will push
    under `transfer_id`."""

    transfer_id: str
    remote_host: str
    remote_port: int
    remote_engine_id: str | None = None
    remote_tls: bool = False

    @property
    def mode(self) -> TransferMode:
        return TransferMode.PUSH

    @property
    def prefill_address(self) -> str:
        return kv_address(self.remote_host, self.remote_port, self.remote_tls)

    def to_wire(self) -> dict[str, Any]:
        return _without_plain({
            "transfer_id": self.transfer_id, "transfer_mode": TransferMode.PUSH.value,
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.remote_engine_id, "remote_host": self.remote_host,
            "remote_port": self.remote_port, "remote_tls": self.remote_tls})

    @staticmethod
    def from_wire(data: object) -> PushDecodeParams:
        f = _fields(data, frozenset({"transfer_id", "transfer_mode", "remote_host",
                                     "remote_port", "remote_engine_id", "remote_tls"}))
        if f.pop("transfer_mode", "push") != "push":
            raise ProtocolError("a push decode leg has transfer_mode push")
        return from_fields(PushDecodeParams, f)


@dataclass(frozen=True)
class PushOverlap:
    """How much of a push was hidden behind compute: blocks written before the prompt
    finished, and the time that stayed exposed after it (None: nothing was streamed)."""

    blocks: int
    early_blocks: int = 0
    exposed_ms: float | None = None


@dataclass(frozen=True)
class PushPrefillResult:
    """Push prefill -> router: the KV is in the decode; what moved and from where."""

    transfer_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    num_tokens: int
    num_bytes: int
    first_token: TokenLogprobWire
    push_overlap: PushOverlap

    def to_wire(self) -> dict[str, Any]:
        return {"transfer_mode": TransferMode.PUSH.value, **to_fields(self),
                "do_remote_prefill": True, "do_remote_decode": False}

    @staticmethod
    def from_wire(data: object) -> PushPrefillResult:
        f = _fields(data, frozenset({"transfer_mode", "transfer_id", "remote_engine_id",
                                     "remote_host", "remote_port", "num_tokens", "num_bytes",
                                     "first_token", "push_overlap"}))
        if f.pop("transfer_mode", None) != "push":
            raise ProtocolError("a push prefill result has transfer_mode push")
        return from_fields(PushPrefillResult, f)
