"""Messages to prefill ranks that need no handshake and get no answer.

`Abandoner`: what a router (the proxy, a test client) tells prefill engines, ABANDON a
transfer. `SourceAnnouncer`: what a prefill engine's scheduler tells its own ranks, SOURCE
(see `wire.SourceMsg`).

A client that leaves can beat its decode leg into decode's engine: the leg is still in vLLM's
API server when it is aborted, so decode's connector never hears of it and cannot cancel.
Prefill, whose leg finished, would then hold its blocks for the whole lease. The router knows
both the transfer and the prefill engine, so it tells every prefill rank directly. The message
needs no handshake and gets no answer; sending never blocks (ZMQ queues it until the
connection is up, and drops it at close if it never is: the lease still bounds that case).
"""

from __future__ import annotations

import logging

import zmq

from kvpush.transfer import wire
from kvpush.transfer.wire import PrefillAddress

log = logging.getLogger(__name__)

_LINGER_MS = 200  # at close, give queued messages this long to leave


class RankMessenger:
    """One DEALER socket per prefill rank address, reused; safe to call from one thread."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, prefill: PrefillAddress, msg: wire.Msg) -> None:
        """Queue `msg` for every rank of `prefill`; never blocks, never raises (a message
        that cannot be queued is logged and dropped: each has a slower path behind it)."""
        data = wire.encode(wire.Envelope("router", "", msg))
        for rank in range(prefill.tp_size):
            address = prefill.rank_address(rank)
            try:
                self._socket(address).send(data, zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("could not send %s to %s: %s", type(msg).__name__, address, e)

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, _LINGER_MS)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            try:
                sock.connect(address)
            except zmq.ZMQError:
                sock.close()
                raise
            self._sockets[address] = sock
        return sock

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
        self._ctx.term()


class Abandoner(RankMessenger):
    def abandon(self, prefill: PrefillAddress, transfer_id: str, reason: str) -> None:
        """Tell every rank of `prefill` that `transfer_id` (its first sub-request: the proxy
        refuses prompt lists and n > 1) is gone; the lease bounds a message that is lost."""
        self.send(prefill, wire.AbandonMsg(wire.TransferKey(transfer_id, 0), reason))


class SourceAnnouncer(RankMessenger):
    def announce(
        self,
        prefill: PrefillAddress,
        key: wire.TransferKey,
        block_ids: list[int],
        num_tokens: int,
        first_token: int,
    ) -> None:
        """Tell every rank of this prefill engine that `key`'s KV is ready in `block_ids`;
        the worker's push of the same key, one engine step later, is the slower path."""
        self.send(prefill, wire.SourceMsg(key, list(block_ids), num_tokens, first_token))
