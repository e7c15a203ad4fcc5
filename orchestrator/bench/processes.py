"""Private infrastructure for benchmarks and tests: a redis-server and real Celery worker processes.

Both run in their own process group so that stopping them also stops their children (pool
processes, sandboxes). Nothing here depends on pytest; `tests/conftest.py` can wrap these classes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import redis
from celery import Celery
from kombu.exceptions import OperationalError

ROOT = Path(__file__).resolve().parents[2]


class ProcessStartError(RuntimeError):
    """A helper process could not be started (missing binary, early exit, not ready in time)."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def output_of_fork(work: Callable[[], bytes]) -> bytes:
    """What `work` returns when run in a fork of this process (which then ends without cleanup
    handlers: they belong to the parent). `work` reports its own failures in what it returns."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.write(write_fd, work())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 1 << 16):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    return b"".join(chunks)


def _stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the process group, then SIGKILL it if it is still there after `timeout`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def _own_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process has used, with the children it has reaped."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: utime stime cutime cstime are the 12th to 15th fields.
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def process_tree_cpu_seconds(root: int) -> float:
    """CPU seconds used by a process and all its live descendants, with the children they reaped.

    Descendants rather than the process group: a worker's sandbox zygote runs in a session of its
    own, and its children in groups of their own. A process that ended unreaped counts nothing.
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended while we looked
            children.setdefault(parent, []).append(int(entry.name))
    total, pending = 0.0, [root]
    while pending:
        pid = pending.pop()
        try:
            total += _own_cpu_seconds(pid)
        except (OSError, IndexError, ValueError):
            continue
        pending.extend(children.get(pid, []))
    return total


def _running_cpu_seconds(proc: subprocess.Popen[bytes] | None) -> float:
    return process_tree_cpu_seconds(proc.pid) if proc is not None and proc.poll() is None else 0.0


class RedisServer:
    """A private redis-server on a free loopback port, with nothing persisted."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ProcessStartError(
                "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)"
            )
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0, *, appendonly: bool = False) -> None:
        """Start the server and wait until it answers PING (it usually does within milliseconds;
        the margin is for a machine whose cores are all busy).

        `appendonly` turns the append-only file on with an fsync per write, so a restart (even
        after SIGKILL) keeps every key: a Redis restart that loses nothing.
        """
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if appendonly else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence,
             "--dir", str(self.workdir), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.proc.poll() is not None:
                        break
                    time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        raise ProcessStartError(f"redis-server did not start on port {self.port}")

    def cpu_seconds(self) -> float:
        """CPU time the running server has used so far (0 when it is not running)."""
        return _running_cpu_seconds(self.proc)

    def stop(self) -> None:
        """Kill the server (with the append-only file on, every write was already fsynced)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None


def worker_env(
    redis_url: str, tool_modules: str, base: Mapping[str, str] | None = None, /, **extra: str
) -> dict[str, str]:
    """Environment for a worker on `redis_url` loading `tool_modules`; other TOOLCHORD_* variables dropped."""
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if not k.startswith("TOOLCHORD_")}
    env.update(
        TOOLCHORD_BROKER_URL=redis_url,
        TOOLCHORD_TOOL_MODULES=tool_modules,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])),
    )
    env.update(extra)
    return env


class WorkerProcess:
    """A real worker, started as users start one (`toolchord worker`, prefork pool), in its own process group."""

    def __init__(self, env: dict[str, str], queues: str, concurrency: int, name: str, log: Path,
                 loglevel: str = "INFO", include: Sequence[str] = (), args: Sequence[str] = ()) -> None:
        """`include`: modules of plain Celery tasks the worker's app imports (Celery's `--include`),
        unlike tool modules (TOOLCHORD_TOOL_MODULES) not imported by the sandbox zygote; `args`: more
        `toolchord worker` options (for instance `--max-tasks-per-child 1`)."""
        self.env, self.queues, self.concurrency, self.name, self.log = env, queues, concurrency, name, log
        self.loglevel, self.include, self.args = loglevel, tuple(include), tuple(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start the worker and wait for its ` ready.` log line; a worker that does not get there
        (or whose wait fails) is killed again, never left running."""
        include = ["--include", ",".join(self.include)] if self.include else []
        with self.log.open("ab") as handle:
            # `toolchord worker` execs `celery worker --pool prefork --task-events` on toolchord's app.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "toolchord.orchestrator.cli", "worker", "--concurrency", str(self.concurrency),
                 "--queues", self.queues, "--hostname", f"{self.name}@%h", "--loglevel", self.loglevel,
                 "--without-mingle", "--without-gossip", *include, *self.args],
                env=self.env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            )
        try:
            self._wait_until_ready(timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_until_ready(self, timeout: float) -> None:
        assert self.proc is not None
        # Celery logs " ready." at INFO; above that level, ask the worker itself with a control ping.
        pinger = Celery("toolchord-ping", broker=self.env["TOOLCHORD_BROKER_URL"], set_as_current=False)
        with pinger.connection_for_write() as connection:
            # Whatever the transport raises when the broker drops or refuses a connection (a broker
            # restarting, py-amqp's bare socket errors): not an answer yet, ask again.
            broker_errors = (OperationalError, redis.RedisError, *connection.connection_errors, *connection.channel_errors)
        node = f"{self.name}@{socket.gethostname()}"
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ProcessStartError(f"worker {self.name} exited early:\n{self._log_tail()}")
                if b" ready." in self.log.read_bytes() or self._answers_ping(pinger, node, broker_errors):
                    return
        finally:
            pinger.close()
        raise ProcessStartError(f"worker {self.name} not ready in {timeout}s:\n{self._log_tail()}")

    @staticmethod
    def _answers_ping(pinger: Celery, node: str, broker_errors: tuple[type[BaseException], ...]) -> bool:
        try:
            return bool(pinger.control.ping(destination=[node], timeout=0.2))
        except broker_errors:
            return False

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def cpu_seconds(self) -> float:
        """CPU time the running worker has used so far: main process, pool processes, sandbox
        zygotes and their children (0 when it is not running; a killed worker takes its time with it)."""
        return _running_cpu_seconds(self.proc)

    def kill(self) -> None:
        """SIGKILL the whole process group: main process, pool children and sandboxes."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """Warm shutdown (SIGTERM to the group), then SIGKILL after `timeout`."""
        if self.proc is not None:
            _stop_group(self.proc, timeout)


__all__ = ["ROOT", "ProcessStartError", "RedisServer", "WorkerProcess", "free_port", "process_tree_cpu_seconds",
           "worker_env"]
