"""Helpers for tests that run turns on the private Redis and real workers (tests/celery_tools.py)."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.result import AsyncResult

from toolchord.orchestrator import Orchestrator
from toolchord.worker import Registry, ToolCall
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import Settings
from toolchord.worker.payloads import CallPayload
from toolchord.worker.result_backend import call_task_id
from toolchord.worker.tasks import TASK_NAMES

TOOLS = "tests.celery_tools"


def settings_for(url: str, broker_url: str | None = None) -> Settings:
    """Settings matching the workers the fixtures start (see tests/conftest.py worker_env); the
    broker is the Redis at `url` unless `broker_url` names another (RabbitMQ)."""
    return Settings(broker_url=broker_url or url, result_backend=url, redis_url=url, visibility_timeout=8,
                    claim_lease=2)


def orchestrator(url: str, broker_url: str | None = None, **kwargs: Any) -> Orchestrator:
    """An orchestrator on the test cluster with the test tools."""
    registry = Registry.from_modules([TOOLS])
    return Orchestrator(registry, create_app(settings_for(url, broker_url), registry), **kwargs)


def call(i: int, name: str, **args: object) -> ToolCall:
    """The model's i-th call of a turn."""
    return ToolCall(id=f"call_{i}", name=name, arguments_raw=json.dumps(args), index=i)


def effects(client: redis.Redis, key: str) -> int:
    """How many times a counting tool acted for `key`."""
    return int(client.get(f"tc-test:effects:{key}") or 0)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Start `fn` in a thread; its return value lands in the box under "value"."""
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, box


def send_call(app: Celery, name: str, arguments: dict[str, Any], key: str, deadline: float) -> AsyncResult:
    """Send one call of a test tool straight to the workers, as the orchestrator sends a call (its
    task, payload and time limits) but outside any turn: its task keeps its own result, which
    `task_meta` reads, and the idempotency store has it under `key`."""
    spec = Registry.from_modules([TOOLS])[name]
    payload = CallPayload(call=call(0, name, **arguments), arguments=arguments, key=key, session_id="s-" + key,
                          turn_id="t-" + key, deadline=deadline)
    # A call task's id, as the orchestrator gives: the result backend subscribes to nothing for it,
    # so the call can be sent while the backend's Redis is away.
    return app.signature(TASK_NAMES[spec.side_effect], kwargs={"payload": payload.model_dump(mode="json")},
                         task_id=call_task_id(uuid.uuid4().hex), time_limit=spec.timeout + 10).apply_async()


def task_meta(app: Celery, task_id: str) -> dict[str, Any]:
    """What the result backend holds for a task (nothing while its Redis is away)."""
    try:
        return dict(app.backend.get_task_meta(task_id))
    except redis.ConnectionError:
        return {}


class Forwarder:
    """A TCP forwarder in front of a server that can be frozen (a partition) or slowed (latency).

    `freeze()` stops carrying bytes both ways while every connection stays open, as a network
    partition does: neither side sees an error, what they send waits in the forwarder. `thaw()`
    delivers what waited and carries on. `delay` holds every chunk that long in each direction
    (one-way latency; the round trip costs twice that). New connections are accepted while frozen,
    and their bytes wait like the others.
    """

    def __init__(self, upstream_port: int, *, delay: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay = delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        # Chunks that arrived from a client while frozen (a client blocked on the partition).
        self.held_from_clients = 0
        self._sockets: list[socket.socket] = []
        self._closed = False
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
        """Close the listener and every connection (the forwarder's peers see them drop)."""
        self._closed = True
        self._flowing.set()
        with self._lock:
            sockets, self._sockets = list(self._sockets), []
        for sock in [self.listener, *sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                return
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink, from_client in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._carry, args=(source, sink, from_client), daemon=True).start()

    def _carry(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        """Copy one direction; while frozen, what arrives waits here."""
        chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()
        sender = threading.Thread(target=self._send, args=(chunks, sink), daemon=True)
        sender.start()
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if data and not self._flowing.is_set() and from_client:
                with self._lock:
                    self.held_from_clients += 1
            chunks.put((time.monotonic() + self.delay, data))
            if not data:
                return

    def _send(self, chunks: queue.Queue[tuple[float, bytes]], sink: socket.socket) -> None:
        while True:
            due, data = chunks.get()
            self._flowing.wait()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._flowing.wait()
            try:
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(data)
            except OSError:
                return
