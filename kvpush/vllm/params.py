"""`kv_transfer_params` of one request: parsed, checked, and turned into a transfer key.

Field names are those of vLLM's own push and pull connectors, so routers written for them
can drive kvpush. No vLLM import: the validation middleware and the proxy use this too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvpush.transfer.wire import PrefillAddress, TransferKey

# vLLM appends "-" and 8 random hex characters to the request id it was given.
_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


class ParamsError(ValueError):
    """Malformed or contradictory kv_transfer_params; the message names the field."""


class _Params(msgspec.Struct):
    """The fields kvpush reads; any others (a pull connector's) are left to their owner."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    transfer_id: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    pp_size: int = 1
    remote_host: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    remote_engine_id: str | None = None


@dataclass(frozen=True)
class PushParams:
    leg: str  # "prefill" (do_remote_decode: write to decode) or "decode" (do_remote_prefill)
    transfer_id: str | None
    prefill: PrefillAddress | None  # decode leg only: where prefill's ranks listen

    def key(self, request_id: str) -> TransferKey:
        """The transfer_id when the router sent one, else the router's own request id."""
        if self.transfer_id is not None:
            return TransferKey(self.transfer_id)
        return TransferKey(external_request_id(request_id))


def external_request_id(request_id: str) -> str:
    """The id the router sent (X-Request-Id), before vLLM added its random suffix."""
    match = _VLLM_SUFFIX.search(request_id)
    return request_id[: match.start()] if match else request_id


def validation_error(error: msgspec.ValidationError, name: str) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.tp_size`" as "name.tp_size: expected `int` >= 1"."""
    what, _, where = str(error).partition(" - at `$")
    where = where.rstrip("`")
    return f"{name}{where}: {what[:1].lower()}{what[1:]}"


def parse(params: Any) -> PushParams | None:
    """None for a request that is not disaggregated; ParamsError for a bad one."""
    if params is None:
        return None
    try:
        p = msgspec.convert(params, _Params)
    except msgspec.ValidationError as e:
        raise ParamsError(validation_error(e, "kv_transfer_params")) from None
    if p.do_remote_prefill and p.do_remote_decode:
        raise ParamsError(
            "kv_transfer_params: do_remote_prefill and do_remote_decode are both true; "
            "a leg is either prefill (do_remote_decode) or decode (do_remote_prefill)"
        )
    if p.pp_size != 1:
        raise ParamsError(f"kv_transfer_params.pp_size={p.pp_size}: only 1 is supported")
    if p.do_remote_decode:
        return PushParams("prefill", p.transfer_id, None)
    if not p.do_remote_prefill:
        return None
    if p.remote_host is None or p.remote_port is None:
        name = "remote_host" if p.remote_host is None else "remote_port"
        raise ParamsError(f"kv_transfer_params.{name} is required with do_remote_prefill")
    address = PrefillAddress(p.remote_host, p.remote_port, p.tp_size, p.remote_engine_id)
    return PushParams("decode", p.transfer_id, address)
