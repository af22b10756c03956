"""What the scheduler half tells the worker half each engine step (a list of actions)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpush.transfer.wire import Failure, PrefillAddress, TransferKey


@dataclass(frozen=True)
class Push:
    """Prefill: the request finished; write its blocks to decode, then free them."""

    req_id: str
    key: TransferKey
    block_ids: list[int]
    num_tokens: int
    finished_s: float = 0.0  # time.monotonic() when vLLM finished it (the timeline's start)
    first_token: int = -1  # the token prefill sampled: decode continues from it
    fault: str = ""  # debug_faults (tests only): the worker hook that raises for it


@dataclass(frozen=True)
class Prepare:
    """Prefill: this step computes the request's last prompt tokens, in these blocks: make
    its push's WRITEs ready meanwhile (a head start; the Push still comes), and with
    `layerwise` write each layer's KV as the forward computes it."""

    key: TransferKey
    block_ids: list[int]
    num_tokens: int
    layerwise: bool = False


@dataclass(frozen=True)
class Abort:
    """Prefill: the request failed or was aborted; tell decode, hold nothing."""

    key: TransferKey
    failure: Failure


@dataclass(frozen=True)
class Expect:
    """Decode: register these blocks with prefill and wait for the WRITEs."""

    req_id: str
    key: TransferKey
    prefill: PrefillAddress
    block_ids: list[int]
    num_tokens: int
    num_cached_tokens: int
    fault: str = ""  # debug_faults (tests only): the worker hook that raises for it


@dataclass(frozen=True)
class Cancel:
    """Decode: the request was aborted. req_id None: it never registered, nothing is held."""

    req_id: str | None
    key: TransferKey
    prefill: PrefillAddress


@dataclass(frozen=True)
class Refuse:
    """Decode: fail the request alone, as a load failure: its params are bad (cause
    "refused") or a connector hook raised for it ("hook")."""

    req_id: str
    failure: Failure


Action = Push | Prepare | Abort | Expect | Cancel | Refuse


@dataclass
class PushMetadata(KVConnectorMetadata):
    actions: list[Action] = field(default_factory=list)
    idle: bool = False  # the step schedules no tokens: the workers may wait for transfers
