"""A TCP forwarder on a loopback port in front of a server, with the hooks tests use to disturb or
watch a link: a partition, latency, a connection stopped at a chosen chunk, round trips counted."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable


class _Link:
    """One forwarded connection: its two sockets, and what the forwarder knows of its traffic."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        # The client has sent and has had no answer yet (a round trip is open).
        self.waiting = False
        # A chunk was held: the connection carries nothing more.
        self.stopped = threading.Event()
        self._ended = 0
        self._lock = threading.Lock()

    def end_direction(self) -> None:
        """One direction reached its end; the connection closes when both have."""
        with self._lock:
            self._ended += 1
            if self._ended == 2:
                self.close()

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.close()


class Forwarder:
    """Forwards every connection made to `port` (0: a free one, then in `self.port`) to `host:upstream_port`.

    - `freeze()` stops carrying bytes both ways while every connection stays open, as a network
      partition does: neither side sees an error, what they send waits in the forwarder. `thaw()`
      delivers what waited and carries on. New connections are accepted while frozen, and their
      bytes wait like the others. `held_from_clients` counts the chunks clients sent since `freeze()`.
    - `delay` holds every chunk that long in each direction (one-way latency; the round trip costs
      twice that).
    - `hold(to_upstream, chunk)`, once `armed` is set, picks a chunk to stop a connection at: that
      chunk is not passed on, `held` is set, and the connection carries nothing more until `close()`
      (which sets `released`) ends it.
    - `round_trips` counts the times a client sent after the server had answered it; a chunk for
      which `counted(chunk)` is false opens a round trip without counting it.
    """

    def __init__(self, upstream_port: int, *, host: str = "127.0.0.1", port: int = 0, delay: float = 0.0,
                 hold: Callable[[bool, bytes], bool] | None = None,
                 counted: Callable[[bytes], bool] = lambda chunk: True) -> None:
        self.upstream = (host, upstream_port)
        self.delay, self.hold, self.counted = delay, hold, counted
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port: int = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.held = threading.Event()
        self.released = threading.Event()
        self.held_from_clients = 0
        self.round_trips = 0
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        threading.Thread(target=self._accept, name="forwarder-accept", daemon=True).start()

    def url(self, db: int = 0) -> str:
        """A Redis URL through the forwarder."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def freeze(self) -> None:
        """Stop carrying bytes: connections stay open and silent."""
        with self._lock:
            self.held_from_clients = 0
        self._flowing.clear()

    def thaw(self) -> None:
        """Carry bytes again, those that waited first."""
        self._flowing.set()

    def close(self) -> None:
        """Stop accepting and close every connection (the forwarder's peers see them drop)."""
        self.released.set()
        self._flowing.set()
        with self._lock:
            links, self._links = self._links, []
        # shutdown() wakes the accepting thread, which close() alone would leave blocked.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for link in links:
            link.close()

    def _accept(self) -> None:
        while not self.released.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        link = _Link(client, upstream)
        with self._lock:
            if self.released.is_set():
                link.close()
                return
            self._links.append(link)
        for source, sink, to_upstream in ((client, upstream, True), (upstream, client, False)):
            threading.Thread(target=self._carry, args=(link, source, sink, to_upstream), daemon=True).start()

    def _carry(self, link: _Link, source: socket.socket, sink: socket.socket, to_upstream: bool) -> None:
        """Read one direction and queue its chunks for the sender; while frozen, they wait there."""
        chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()
        threading.Thread(target=self._send, args=(link, chunks, sink), daemon=True).start()
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if data and self._holds(to_upstream, data):
                link.stopped.set()
                self.held.set()
                self.released.wait()
                link.close()
                return
            if data:
                self._note(link, to_upstream, data)
            chunks.put((time.monotonic() + self.delay, data))
            if not data:
                return

    def _holds(self, to_upstream: bool, data: bytes) -> bool:
        return self.hold is not None and self.armed.is_set() and self.hold(to_upstream, data)

    def _note(self, link: _Link, to_upstream: bool, data: bytes) -> None:
        """Count what the tests read: chunks sent into a partition, round trips."""
        with self._lock:
            if not to_upstream:
                link.waiting = False
                return
            if not self._flowing.is_set():
                self.held_from_clients += 1
            if not link.waiting and self.counted(data):
                self.round_trips += 1
            link.waiting = True

    def _send(self, link: _Link, chunks: queue.Queue[tuple[float, bytes]], sink: socket.socket) -> None:
        while True:
            due, data = chunks.get()
            self._flowing.wait()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._flowing.wait()
            if link.stopped.is_set():
                return
            try:
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    link.end_direction()
                    return
                sink.sendall(data)
            except OSError:
                link.end_direction()
                return
