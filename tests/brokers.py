"""A private vhost on the local RabbitMQ, so test sessions (and engineers) running at once don't collide.

The server's address comes from TC_TEST_RABBITMQ (default: guest on the loopback's port 5672);
vhosts are managed with `rabbitmqctl`, which must run on the same machine.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import IO

import pytest
from kombu import Connection
from kombu.transport.native_delayed_delivery import MAX_LEVEL, level_name

RABBITMQ_ENV = "TC_TEST_RABBITMQ"
DEFAULT_RABBITMQ = "amqp://guest:guest@127.0.0.1:5672"
# Queues the tests' tools use, and Celery's delay queues (retry countdowns on quorum queues).
TEST_QUEUES = ("toolchord", "b", *(level_name(level) for level in range(MAX_LEVEL + 1)))
# Test processes that use the server at once (pytest-xdist workers, other checkouts) hold this file
# locked shared; a test that restarts the server holds it exclusively, so no other test sees a
# restart it did not ask for.
LOCK_PATH = Path(tempfile.gettempdir()) / "toolchord-tests-rabbitmq.lock"


@cache
def _lock_file() -> IO[str]:
    return open(LOCK_PATH, "a")  # held for the life of the process: flock belongs to the open file


def _lock(operation: int) -> None:
    fcntl.flock(_lock_file(), operation)


@contextmanager
def using_rabbitmq() -> Iterator[None]:
    """Use the local RabbitMQ alongside other test processes; `RabbitVhost.restart_app` waits for them."""
    _lock(fcntl.LOCK_SH)
    try:
        yield
    finally:
        _lock(fcntl.LOCK_UN)


class RabbitUnavailable(RuntimeError):
    """No RabbitMQ to test with (not installed, not running, or rabbitmqctl failing)."""


def rabbitmqctl(*args: str, timeout: float = 60.0) -> str:
    """Run `rabbitmqctl` and return its output; RabbitUnavailable when it fails."""
    binary = shutil.which("rabbitmqctl")
    if binary is None:
        raise RabbitUnavailable("rabbitmqctl is not installed (Debian/Ubuntu: apt-get install rabbitmq-server)")
    try:
        done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise RabbitUnavailable(f"rabbitmqctl {' '.join(args)} timed out") from exc
    if done.returncode != 0:
        raise RabbitUnavailable(f"rabbitmqctl {' '.join(args)} failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return done.stdout


class RabbitVhost:
    """A vhost of its own on the local RabbitMQ (guest may use it), with a delivery limit policy."""

    def __init__(self, server: str | None = None, delivery_limit: int = 20) -> None:
        self.server = (server or os.environ.get(RABBITMQ_ENV) or DEFAULT_RABBITMQ).rstrip("/")
        self.name = f"toolchord-test-{uuid.uuid4().hex[:10]}"
        self.delivery_limit = delivery_limit
        self.created = False

    @property
    def url(self) -> str:
        return f"{self.server}/{self.name}"

    def create(self) -> None:
        """Create the vhost, let guest use it, and set the quorum queues' delivery limit as a policy."""
        with Connection(f"{self.server}//", connect_timeout=5) as probe:
            try:
                probe.ensure_connection(max_retries=1)
            except Exception as exc:  # kombu raises the transport's own errors here
                raise RabbitUnavailable(f"no RabbitMQ answers at {probe.as_uri()}: {exc}") from exc
        user = Connection(self.server).userid or "guest"
        rabbitmqctl("add_vhost", self.name)
        self.created = True
        try:
            rabbitmqctl("set_permissions", "-p", self.name, user, ".*", ".*", ".*")
            # A policy rather than an x-delivery-limit argument: it can change without redeclaring queues.
            rabbitmqctl("set_policy", "-p", self.name, "--apply-to", "queues", "delivery-limit", ".*",
                        f'{{"delivery-limit": {self.delivery_limit}}}')
        except RabbitUnavailable:
            self.delete()
            raise

    def purge(self, queues: tuple[str, ...] = TEST_QUEUES, timeout: float = 30.0) -> None:
        """Drop the messages a previous test left in `queues` (a queue not declared yet is skipped),
        once no consumer is left on them: a killed worker's deliveries go back to their queue when
        RabbitMQ sees its connection drop, and one requeued after the purge would reach the next test."""
        deadline = time.monotonic() + timeout
        with Connection(self.url) as connection:
            for queue in queues:
                channel = connection.channel()
                try:
                    while channel.queue_declare(queue, passive=True).consumer_count:
                        if time.monotonic() > deadline:
                            raise AssertionError(f"queue {queue} still has consumers {timeout} s after the test")
                        time.sleep(0.02)
                    channel.queue_purge(queue)
                except connection.channel_errors:
                    continue  # NOT_FOUND closed this channel; the next queue gets a new one
                channel.close()

    def delete(self) -> None:
        """Delete the vhost and everything in it."""
        if self.created:
            rabbitmqctl("delete_vhost", self.name)
            self.created = False

    def restart_app(self) -> None:
        """Stop and start the RabbitMQ application (the Erlang node stays up): every connection drops.

        Call it inside `using_rabbitmq()`: it turns that shared hold into an exclusive one for the
        restart, waiting until no other test process uses the server."""
        _lock(fcntl.LOCK_EX)
        try:
            rabbitmqctl("stop_app")
        finally:
            # Whatever stop_app did, leave the shared server running.
            rabbitmqctl("start_app")
            rabbitmqctl("await_startup")
            _lock(fcntl.LOCK_SH)


__all__ = ["DEFAULT_RABBITMQ", "LOCK_PATH", "RABBITMQ_ENV", "TEST_QUEUES", "RabbitUnavailable", "RabbitVhost", "rabbitmqctl",
           "using_rabbitmq"]


def private_vhost() -> Iterator[RabbitVhost]:
    """A fixture body: a new vhost on the local RabbitMQ, deleted afterwards; skip without RabbitMQ."""
    vhost = RabbitVhost()
    try:
        with using_rabbitmq():
            vhost.create()
    except RabbitUnavailable as exc:
        pytest.skip(f"RabbitMQ broker tests skipped: {exc}")
    yield vhost
    with using_rabbitmq():
        vhost.delete()
