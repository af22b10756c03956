"""Side channel: one ZMQ ROUTER to listen on, one DEALER per peer to send on.

Every rank listens on its configured address and sends through its own DEALER to each
peer's listener, so each side watches its outbound connection (a ZMQ socket monitor) and
knows when a peer's TCP connection is gone. Liveness is heartbeat silence *and* a gone
connection: a peer that is only slow (still connected) is never declared dead, since
declaring it dead frees blocks it might still write into. A peer restarted on the same
address is caught by its new instance id on the first message it sends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvpush.transfer import wire

log = logging.getLogger(__name__)

_LINGER_MS = 0  # never block close() on unsent messages to a dead peer
_RECONNECT_IVL_MS = 200  # retry a refused connection this often (ZMQ default is 100)


@dataclass
class Link:
    address: str
    dealer: zmq.Socket
    monitor: zmq.Socket
    connected: bool = False
    dropped: bool = False  # the connection broke since the last handshake: check the peer
    last_seen_s: float = field(default_factory=time.monotonic)
    last_sent_s: float = 0.0
    peer: wire.PeerInfo | None = None  # known once the handshake completed


class SideChannel:
    def __init__(self, host: str, port: int) -> None:
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, _LINGER_MS)
        try:
            if port:
                self._router.bind(f"tcp://{host}:{port}")
            else:
                port = self._router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self._router.close()
            self._ctx.term()
            raise OSError(f"side channel cannot bind tcp://{host}:{port}: {e}") from e
        self.address = f"tcp://{host}:{port}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.links: dict[str, Link] = {}  # by address
        self._by_monitor: dict[zmq.Socket, Link] = {}

    def wake(self) -> None:
        """Any thread may call this to end the loop thread's poll early."""
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def link(self, address: str) -> Link:
        link = self.links.get(address)
        if link is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, _LINGER_MS)
            dealer.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
            monitor = dealer.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
            )
            dealer.connect(address)
            link = Link(address, dealer, monitor)
            self.links[address] = link
            self._by_monitor[monitor] = link
            self._poller.register(monitor, zmq.POLLIN)
        return link

    def drop(self, address: str) -> None:
        link = self.links.pop(address, None)
        if link is None:
            return
        self._poller.unregister(link.monitor)
        del self._by_monitor[link.monitor]
        link.dealer.disable_monitor()
        link.monitor.close()
        link.dealer.close()

    def send(self, link: Link, sender: str, msg: wire.Msg) -> None:
        try:
            envelope = wire.Envelope(sender, self.address, msg)
            link.dealer.send(wire.encode(envelope), zmq.NOBLOCK)
            link.last_sent_s = time.monotonic()
        except zmq.Again:
            log.debug("side channel to %s not connected; dropped %s", link.address, msg)

    def is_dead(self, link: Link, silence_s: float) -> bool:
        return not link.connected and time.monotonic() - link.last_seen_s >= silence_s

    def poll(self, timeout_ms: int | None) -> list[wire.Envelope]:
        """Wait up to timeout_ms (None: until woken) and return the messages that came in."""
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        for sock in events:
            link = self._by_monitor.get(sock)
            if link is None:
                continue
            while True:
                try:
                    event = parse_monitor_message(sock.recv_multipart(zmq.NOBLOCK))["event"]
                except zmq.Again:
                    break
                if event == zmq.EVENT_CONNECTED:
                    link.connected = True
                elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    link.connected = False
                    link.dropped = True
        out: list[wire.Envelope] = []
        if self._router in events:
            while True:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    out.append(wire.decode_envelope(frames[-1]))
                except msgspec.DecodeError as e:
                    log.warning("side channel: dropped a malformed message: %s", e)
        return out

    def close(self) -> None:
        for address in list(self.links):
            self.drop(address)
        self._router.close()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
