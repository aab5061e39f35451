"""The `kv_transfer_params` request field, parsed into the P/D leg it asks this worker to serve.

The shapes are the P/D contract (shared.protocol.pd); this module validates them field by
field so that anything malformed is a 400 naming the exact `kv_transfer_params.<field>`,
before any KV is touched. `null`, `{}` or both routing flags false mean a plain request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.errors import BadRequestError
from services.worker.fields import Fields, invalid
from shared.protocol.codec import ProtocolError
from shared.protocol.messages import TRANSFER_MODES
from shared.protocol.pd import (
    PARAM,
    ROUTING_FLAGS,
    KVTransferParams,
    PrefillLegParams,
    PushDecodeParams,
    TransferMode,
)


@dataclass(frozen=True)
class PullDecodeLeg:
    """Continue a request whose prompt KV a prefill leased; `params` say where it is."""

    params: KVTransferParams

    @property
    def mode(self) -> TransferMode:
        return TransferMode(self.params.transfer_mode)


DecodeLeg = PullDecodeLeg | PushDecodeParams
Leg = PrefillLegParams | DecodeLeg


def _flag(f: Fields, name: str) -> bool:
    return f.boolean(name, False)


def _transfer_id(f: Fields) -> str | None:
    value = f.string("transfer_id", None)
    if value is not None and not 1 <= len(value) <= 128:
        raise invalid(f.param("transfer_id"), "must be 1 to 128 characters")
    return value


def _prefill_leg(f: Fields) -> PrefillLegParams:
    transfer_id = _transfer_id(f)
    mode = f.choice("transfer_mode", "push" if transfer_id else "pull", TRANSFER_MODES)
    if (mode == "push") != (transfer_id is not None):
        raise invalid(f.param("transfer_id"), "push mode needs a transfer_id, pull mode takes none")
    return PrefillLegParams(TransferMode(mode), transfer_id, f.string("decode_engine_id", None))


def _push_decode_leg(f: Fields, transfer_id: str) -> PushDecodeParams:
    f.choice("transfer_mode", "push", ("push",))
    host = f.string("remote_host", None)
    port = f.integer("remote_port", None, lo=1, hi=65535)
    if not host or port is None:
        raise invalid(f.param("remote_host"), "a push decode leg needs the prefill's remote_host "
                                              "and remote_port")
    return PushDecodeParams(transfer_id, host, port, f.string("remote_engine_id", None),
                            f.boolean("remote_tls", False))


def parse_kv_transfer_params(value: Any) -> Leg | None:
    """The leg `value` asks for, or None for a plain request; 400 on anything malformed."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(PARAM, "expected an object")
    f = Fields(value, prefix=f"{PARAM}.")
    remote_decode, remote_prefill = _flag(f, "do_remote_decode"), _flag(f, "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise invalid(PARAM, "do_remote_decode and do_remote_prefill are exclusive")
    if remote_decode:
        return _prefill_leg(f)
    if remote_prefill:
        transfer_id = _transfer_id(f)
        if transfer_id is not None:
            return _push_decode_leg(f, transfer_id)
        try:
            return PullDecodeLeg(KVTransferParams.from_wire(value))
        except ProtocolError as exc:
            raise BadRequestError(f"Invalid value for '{PARAM}': {exc}", param=PARAM,
                                  code="kv_bad_params") from None
    if set(value) - ROUTING_FLAGS:
        raise invalid(PARAM, "set do_remote_decode (prefill leg) or do_remote_prefill (decode leg)")
    return None
