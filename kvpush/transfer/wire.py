"""Typed messages of the side channel (msgspec), the compatibility check, and the value types
the routers share with the endpoints (PrefillAddress), so that a router never imports one.

Decode ranks start every conversation: HELLO, then REGISTER / CANCEL per transfer.
Prefill ranks answer with HELLO_ACK, CANCEL_ACK, FAIL and DONE, and announce each WRITE
they post (POSTED), so that decode polls for it closely. Both send HEARTBEAT while
they share pending transfers. A router may send ABANDON to prefill ranks, and prefill's own
scheduler SOURCE, both unanswered. The
data's own completion travels as the NIXL notification of the WRITE (a `WrittenMsg`), so it
can never overtake the data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec

from kvpush.transfer.layout import KVLayout

PROTOCOL_VERSION = 4  # 2: FAIL carries a typed Failure; 3: POSTED; 4: staging slots

# Why a transfer failed, as counted (kvpush:failures{cause}). Set where the failure happens
# and carried on the wire (FAIL), never read back from the words of a reason.
CAUSES = (
    "lease",  # a lease ran out: decode never registered, or prefill never finished
    "dead",  # the peer stopped answering
    "restarted",  # the peer came back as a new instance
    "cancelled",  # decode's request was aborted
    "abandoned",  # the router gave the request up (ABANDON)
    "aborted",  # prefill's request ended without a push (aborted, failed, or no source)
    "handshake",  # the peers could not pair: refused, unknown, or the wrong engine
    "write",  # a WRITE could not be posted or failed in NIXL
    "checksum",  # debug_checksum: what landed is not what prefill sent
    "refused",  # bad kv_transfer_params, or a registration prefill cannot serve
    "hook",  # a connector hook raised for the request
    "other",  # anything else (a bug): the reason says what
)


@dataclass(frozen=True)
class PrefillAddress:
    """Where a prefill engine's ranks listen: rank r on base_port + r."""

    host: str
    base_port: int
    tp_size: int = 1
    engine_id: str | None = None  # when given, the handshake checks it

    def __post_init__(self) -> None:
        if not self.host or not 0 < self.base_port < 65536 or self.tp_size < 1:
            raise ValueError(f"bad prefill address {self.host}:{self.base_port} tp={self.tp_size}")

    def rank_address(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.base_port + rank}"


class TransferKey(msgspec.Struct, frozen=True, array_like=True):
    """The router's transfer_id plus the index of the sub-request (prompt list, n > 1)."""

    transfer_id: str
    sub_index: int = 0

    def __str__(self) -> str:
        return f"{self.transfer_id}#{self.sub_index}"


class Compat(msgspec.Struct, frozen=True):
    """What prefill and decode must agree on; a mismatch is refused at handshake."""

    mode: str  # "push"
    model: str
    dtype: str
    layout_kind: str  # e.g. "head-major/2 regions/64 B per head-token/8 heads"

    def digest(self) -> str:
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]

    def mismatch(self, other: Compat) -> str | None:
        diffs = [
            f"{name}: prefill={getattr(other, name)!r} decode={getattr(self, name)!r}"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs) or None


def layout_kind(layout: KVLayout) -> str:
    order = "head-major" if layout.head_major else "token-major"
    parts = f"/{layout.num_parts} parts" if layout.num_parts > 1 else ""
    if layout.dim_major_parts:
        parts += f" (dim-major: {','.join(map(str, layout.dim_major_parts))})"
    return (
        f"{order}{parts}/{len(layout.regions)} regions/{layout.head_bytes} B per head-token/"
        f"{layout.heads_total} KV heads"
    )


class PeerInfo(msgspec.Struct, frozen=True):
    engine_id: str
    rank: int
    instance_id: str  # random per process start: a restarted peer is a new peer
    side_channel: str  # "tcp://host:port" where this rank listens
    agent_name: str


class HelloMsg(msgspec.Struct, tag="hello"):
    peer: PeerInfo
    agent_metadata: bytes
    layout: KVLayout
    compat: Compat
    protocol_version: int = PROTOCOL_VERSION


def refusal(hello: HelloMsg, compat: Compat, layout: KVLayout) -> str | None:
    """Why prefill (with `compat` and `layout`) refuses decode's handshake; None: it does not."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return (
            f"protocol version mismatch: prefill={PROTOCOL_VERSION} decode={hello.protocol_version}"
        )
    if (diff := hello.compat.mismatch(compat)) is not None:
        return f"incompatible prefill and decode: {diff}"
    if hello.layout.shape_key() != layout.shape_key():
        return (
            f"KV layouts cannot be copied: prefill={layout_kind(layout)} "
            f"decode={layout_kind(hello.layout)}"
        )
    return None


class HelloAckMsg(msgspec.Struct, tag="hello_ack"):
    peer: PeerInfo
    layout: KVLayout | None = None
    error: str | None = None


class RegisterMsg(msgspec.Struct, tag="register"):
    key: TransferKey
    block_ids: list[int]  # decode blocks covering tokens from position 0
    num_tokens: int  # prompt tokens that must end up on decode
    num_cached_tokens: int  # leading tokens decode already holds: not written
    heads: tuple[int, int]  # [start, stop) global heads this prefill rank writes
    num_registrations: int  # decode ranks that register with this prefill rank for the key
    # a staging slot decode reserved for this registration (staging.py): its address in
    # decode's registered staging area and its size; 0: none, prefill writes the blocks
    staging_addr: int = 0
    staging_bytes: int = 0


class CancelMsg(msgspec.Struct, tag="cancel"):
    key: TransferKey


class CancelAckMsg(msgspec.Struct, tag="cancel_ack"):
    key: TransferKey


class Failure(msgspec.Struct, frozen=True):
    """Why a transfer failed: a cause to count by (one of CAUSES) and words for people."""

    cause: str
    reason: str

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"unknown failure cause {self.cause!r}; known: {CAUSES}")

    def __str__(self) -> str:
        return self.reason

    def within(self, context: str) -> Failure:
        """The same cause, its reason prefixed with where it was seen."""
        return Failure(self.cause, f"{context}: {self.reason}")


CANCELLED = Failure("cancelled", "cancelled by decode")


# When a transfer leaves a faster path for the plain one, as counted (kvpush:fallbacks{path,
# cause}): it still completes, slower. Counted so that a systematic failure of a path (which
# would switch its optimisation off silently) shows.
FALLBACK_PATHS = (
    "ready_ahead",  # prefill: the WRITE made ready while prefill computes (prepare_ahead)
    "layerwise",  # prefill: layers written as the forward computes them
    "staged",  # either side: scattered blocks gathered into, or scattered from, a slot
)
FALLBACK_CAUSES = (
    "full",  # no room (a staging area with no slot free)
    "error",  # the path raised or its WRITE could not be posted: the log says why
)


def fallback_key(path: str, cause: str) -> str:
    """The name a fallback is counted under, across processes: "path:cause"."""
    return f"{path}:{cause}"


class FailMsg(msgspec.Struct, tag="fail"):
    key: TransferKey
    failure: Failure


class DoneMsg(msgspec.Struct, tag="done"):
    """Sent instead of a WRITE when there is nothing to write (full prefix hit on decode)."""

    key: TransferKey


class PostedMsg(msgspec.Struct, tag="posted"):
    """A WRITE for `key` was just posted: a hint to poll closely for its notification, which
    alone says the data landed (this message may overtake the data, or come after it)."""

    key: TransferKey


class SourceMsg(msgspec.Struct, tag="source"):
    """From the prefill engine's own scheduler, not a peer: vLLM just finished the request,
    these blocks hold its KV. Sent then, so the endpoint need not wait for the next engine
    step to hear of it; the worker's `push()` of the same key follows and claims it (or
    starts it, when this message comes later or never). No handshake, no answer."""

    key: TransferKey
    block_ids: list[int]
    num_tokens: int
    first_token: int = -1


class HeartbeatMsg(msgspec.Struct, tag="heartbeat"):
    pass


class AbandonMsg(msgspec.Struct, tag="abandon"):
    """From a router, not a decode rank: the client's request is gone. Prefill frees the key's
    blocks (now, or as soon as prefill finishes) and fails its registrations. It needs no
    handshake and gets no answer: its envelope has no reply address."""

    key: TransferKey
    reason: str


Msg = (
    HelloMsg
    | HelloAckMsg
    | RegisterMsg
    | CancelMsg
    | CancelAckMsg
    | FailMsg
    | DoneMsg
    | PostedMsg
    | SourceMsg
    | HeartbeatMsg
    | AbandonMsg
)


class Envelope(msgspec.Struct):
    sender: str  # instance_id of the sending rank
    reply_to: str  # the sending rank's side-channel address
    msg: Msg


class WrittenMsg(msgspec.Struct, array_like=True):
    """NIXL notification attached to each WRITE: arrives only after the data landed."""

    key: TransferKey
    prefill_rank: int
    digest: bytes = b""  # debug_checksum: layout.digest() of what prefill sent
    first_token: int = -1  # the token prefill sampled (decode continues from it); -1: none
    staged_end: int = 0  # >0: the WRITE went to decode's staging slot, tokens up to this one


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_written_decoder = msgspec.msgpack.Decoder(WrittenMsg)


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_envelope(data: bytes) -> Envelope:
    return _envelope_decoder.decode(data)


def decode_written(data: bytes) -> WrittenMsg:
    return _written_decoder.decode(data)
