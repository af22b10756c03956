"""`kv_transfer_params` of one request: parsed, checked, and turned into a transfer key.

Field names are those of vLLM's own push and pull connectors, so routers written for them
can drive kvpush. No vLLM import: the validation middleware and the proxy use this too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvpush.transfer.receiver import PrefillAddress
from kvpush.transfer.wire import TransferKey

# vLLM appends "-" and 8 random hex characters to the request id it was given.
_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


class ParamsError(ValueError):
    """Malformed or contradictory kv_transfer_params; the message names the field."""


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


def _get(params: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = params.get(name, default)
    if value is None or isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ParamsError(
        f"kv_transfer_params.{name} must be {kind.__name__}, got {type(value).__name__} {value!r}"
    )


def parse(params: Any) -> PushParams | None:
    """None for a request that is not disaggregated; ParamsError for a bad one."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    remote_prefill = _get(params, "do_remote_prefill", bool, False)
    remote_decode = _get(params, "do_remote_decode", bool, False)
    if remote_prefill and remote_decode:
        raise ParamsError(
            "kv_transfer_params: do_remote_prefill and do_remote_decode are both true; "
            "a leg is either prefill (do_remote_decode) or decode (do_remote_prefill)"
        )
    if not (remote_prefill or remote_decode):
        return None
    transfer_id = _get(params, "transfer_id", str)
    if transfer_id is not None and not transfer_id.strip():
        raise ParamsError("kv_transfer_params.transfer_id must not be empty")
    pp_size = _get(params, "pp_size", int, 1)
    if pp_size != 1:
        raise ParamsError(f"kv_transfer_params.pp_size={pp_size}: only 1 is supported")
    if remote_decode:
        return PushParams("prefill", transfer_id, None)
    host = _get(params, "remote_host", str)
    port = _get(params, "remote_port", int)
    tp_size = _get(params, "tp_size", int, 1)
    engine_id = _get(params, "remote_engine_id", str)
    if not host:
        raise ParamsError("kv_transfer_params.remote_host is required with do_remote_prefill")
    if port is None or not 0 < port < 65536:
        raise ParamsError(f"kv_transfer_params.remote_port must be a port 1..65535, got {port!r}")
    if tp_size < 1:
        raise ParamsError(f"kv_transfer_params.tp_size must be >= 1, got {tp_size}")
    return PushParams("decode", transfer_id, PrefillAddress(host, port, tp_size, engine_id))
