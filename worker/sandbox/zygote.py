"""The worker's side of the sandbox zygote: start it, hand calls to its children, notice when it
is gone.

A zygote (`toolchord.worker.sandbox.zygote_server`) is a clean `python -I` interpreter with an allow-listed
environment that imports only the tool modules and forks one sandbox child per call, ahead of
time (spare children). The worker sends each call straight to a spare; the child's memory holds
none of the worker's secrets, and no fork happens on the call's path.

One zygote per worker process (each Celery pool child has its own), started by `start_zygote()`
at `worker_process_init` or lazily by the first isolated call. Calls from several threads run
concurrently, each in a spare of its own with its own status socket.

A zygote found dead is replaced at the next call. A call that finds it gone, unable to start or
unable to offer a spare child fails without running (`ZygoteUnavailable`, raised by `submit`):
forking the worker instead would put the worker's secrets in the memory of a call whose handler
may have brought the zygote down on purpose. A zygote that dies more than DEATHS_ALLOWED times
within DEATH_WINDOW_SECONDS is not restarted until the window has passed (calls fail meanwhile).
"""

from __future__ import annotations

import array
import atexit
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn

from toolchord.worker.registry import Registry
from toolchord.worker.sandbox.zygote_protocol import (
    MAX_MESSAGE_BYTES,
    OFFER_FD_COUNT,
    LoadReply,
    SpareOffer,
    ToolLocator,
    ZygoteInit,
    ZygoteReady,
    ZygoteReply,
    ZygoteRequest,
)
from toolchord.worker.sandbox.zygote_server import BOOTSTRAP
from toolchord.worker.tools import ToolSpec, tool

ZYGOTE_ENV = "TOOLCHORD_SANDBOX_ZYGOTE"
"""Set to 0 (or false/off/no) to run every isolated call in a direct fork of the worker."""
ENV_ALLOW: tuple[str, ...] = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
"""The only worker variables the zygote's environment gets."""
START_SECONDS = 30.0
"""Longest wait for a new zygote to import its tool modules and report ready."""
REPLY_SECONDS = 10.0
"""Longest wait for the zygote to load a tool (import its module) or offer a spare child."""
SPARES = 3
"""Spare children kept ready per zygote: calls back to back then take a spare confined ahead two
calls earlier, never one still confining itself (its layers cost milliseconds of CPU) when the
call arrives."""
REFILL_QUIET_SECONDS = 0.03
"""While all spares but one are on offer confined for the calls' profile, the one a call used up
is replaced once no call has taken one for this long: forking and confining it right after the
call competed with what was left of its turn (the stored result, the chord's callback, the
orchestrator's wake-up) for the CPU (docs/benchmarks.md, "Replacement spares after a quiet
moment")."""
REAP_SECONDS = 5.0
"""Longest wait for the zygote to report a killed child's status."""
DEATHS_ALLOWED = 3
DEATH_WINDOW_SECONDS = 60.0
"""After more than DEATHS_ALLOWED deaths (or failed starts) within the window, no new zygote is
started until the oldest of them is older than the window."""

_log = logging.getLogger("toolchord.sandbox")


class ZygoteToolError(Exception):
    """The zygote cannot load this tool; its calls use a direct fork of the worker."""


class ZygoteUnavailable(Exception):
    """The zygote is not running or was lost before the call reached a child: the call did not
    run."""


class _ZygoteLost(Exception):
    """The zygote died or stopped answering."""


@dataclass
class Preparation:
    """Layers sent to a spare ahead of its call (`SpareLayers` JSON), the calls that may use it
    (`key`: their sandbox profile), and what the worker made for it (its workdir and cgroup,
    `held`), released with `release` unless a call took the spare."""

    key: bytes
    message: bytes
    held: object
    release: Callable[[], None]


class _Spare:
    """A child the zygote forked ahead of its call: its pid, call socket and status socket."""

    def __init__(
        self, pid: int, generation: int, call: socket.socket, status: socket.socket
    ) -> None:
        self.pid = pid
        self.generation = generation
        self.call = call
        self.status = status
        self.prepared: Preparation | None = None

    def close(self) -> None:
        """Let the spare go: it exits at end of file on its call socket (or with its cgroup)."""
        self.close_sockets()
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            prepared.release()

    def close_sockets(self) -> None:
        self.call.close()
        self.status.close()


class _Connection:
    """One running zygote: its process, control socket, spare children and loaded tools."""

    def __init__(
        self, process: subprocess.Popen[bytes], sock: socket.socket, pid: int
    ) -> None:
        self.process = process
        self.sock = sock
        self.pid = pid
        self.loaded: dict[bytes, int] = {}
        self._spares: deque[_Spare] = deque()
        self._pending = 0
        self._spare_lock = threading.Lock()
        # When a call last took a spare, and set when a refill must not wait for a quiet moment.
        self._last_take = 0.0
        self._refill_now = threading.Event()

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        # The process first: a thread waiting for a spare offer then sees end of file and lets go
        # of the spare lock before the sockets are closed under it.
        if self.process.poll() is None:
            self.process.kill()
        self._refill_now.set()
        try:
            # Wakes a thread waiting outside the lock for an offer (closing the socket would not).
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._spare_lock:
            self.sock.close()
            while self._spares:
                self._spares.popleft().close()
        try:
            self.process.wait(REAP_SECONDS)
        except subprocess.TimeoutExpired:
            pass

    def abandon(self) -> None:
        """In a forked child: close the inherited sockets (no locks: other threads are gone); the
        spares' workdirs and cgroups stay the parent's."""
        self.sock.close()
        for spare in self._spares:
            spare.close_sockets()

    def describe_end(self) -> str:
        code = self.process.poll()
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with status {code}"

    def send(self, request: ZygoteRequest, fds: tuple[int, ...] = ()) -> None:
        ancillary = (
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            if fds
            else []
        )
        try:
            self.sock.sendmsg([request.model_dump_json().encode()], ancillary)
        except OSError as exc:
            raise _ZygoteLost(f"a request could not be sent ({exc})") from exc

    def expect_spares(self, count: int) -> None:
        self._pending += count

    def load(self, locator: ToolLocator, key: bytes) -> int:
        """Have the zygote import the tool; the generation of spares that have it."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                self.send(ZygoteRequest(load=locator), (theirs.fileno(),))
            finally:
                theirs.close()
            readable, _, _ = select.select([mine], [], [], REPLY_SECONDS)
            raw = mine.recv(MAX_MESSAGE_BYTES) if readable else b""
        finally:
            mine.close()
        if not raw:
            raise _ZygoteLost(f"it did not answer a load within {REPLY_SECONDS:g} s")
        answer = LoadReply.model_validate_json(raw)
        if answer.generation is None:
            raise ZygoteToolError(answer.error or "unknown error")
        self.loaded[key] = answer.generation
        return answer.generation

    def take_spare(self, generation: int, key: bytes) -> _Spare:
        """A spare that has the tool's module and is not confined for other calls than those of
        `key` (asking for more when there is none)."""
        with self._spare_lock:
            deadline = time.monotonic() + REPLY_SECONDS
            while True:
                while self._spares:
                    spare = self._spares.popleft()
                    if spare.generation >= generation and (
                        spare.prepared is None or spare.prepared.key == key
                    ):
                        if not self._spares:
                            # None left for the next call: ask now. Otherwise the call's end
                            # asks (`refill`), so that forking and confining the replacement
                            # do not compete with this call for the CPU.
                            self._replenish()
                        self._last_take = time.monotonic()
                        if self._confined_for(key) < SPARES - 1:
                            self._refill_now.set()
                        return spare
                    # Forked before the tool's module was imported, or confined for a profile
                    # other than this call's.
                    spare.close()
                self._replenish()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _ZygoteLost(
                        f"no spare child was offered within {REPLY_SECONDS:g} s"
                    )
                self._receive_offer(remaining)

    def refill(self, key: bytes, prepare: Callable[[], Preparation]) -> None:
        """After a call: ask for the spares missing, then confine them (and any other spare on
        offer) for calls of `key`; while all but one are on offer confined for `key`, once no
        call has taken one for REFILL_QUIET_SECONDS."""
        self._wait_for_quiet(key)
        with self._spare_lock:
            try:
                self._replenish()
            except _ZygoteLost:
                return  # the next call finds out and starts a new zygote
        self.prepare_spares(key, prepare)

    def _confined_for(self, key: bytes) -> int:
        """How many spares on offer are confined for calls of `key` (under the spare lock)."""
        return sum(spare.prepared is not None and spare.prepared.key == key for spare in self._spares)

    def _wait_for_quiet(self, key: bytes) -> None:
        """Until no call has taken a spare for REFILL_QUIET_SECONDS, while all but one of the
        spares are on offer confined for `key`: a call that leaves fewer (calls back to back), or
        the zygote's end, ends the wait, so that a burst of calls still finds spares confined."""
        while True:
            self._refill_now.clear()
            with self._spare_lock:
                if self._confined_for(key) < SPARES - 1:
                    return
                wait = self._last_take + REFILL_QUIET_SECONDS - time.monotonic()
            if wait <= 0 or self._refill_now.wait(wait):
                return

    def prepare_spares(self, key: bytes, prepare: Callable[[], Preparation]) -> None:
        """Send layers made by `prepare` to every spare that has none yet, those asked for and
        not offered yet included (waiting for them at most REPLY_SECONDS)."""
        deadline = time.monotonic() + REPLY_SECONDS
        while True:
            with self._spare_lock:
                try:
                    while select.select([self.sock], [], [], 0)[0]:
                        self._receive_offer(0)
                except (_ZygoteLost, OSError, ValueError):
                    return  # the next call finds out and starts a new zygote
                for spare in [s for s in self._spares if s.prepared is None]:
                    preparation = prepare()
                    spare.prepared = preparation
                    try:
                        spare.call.send(preparation.message)
                    except OSError:
                        self._spares.remove(spare)
                        spare.close()
                waiting = self._pending > 0
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                return
            try:
                # Outside the lock: a call may take a spare meanwhile.
                select.select([self.sock], [], [], remaining)
            except (OSError, ValueError):
                return

    def _replenish(self) -> None:
        missing = SPARES - len(self._spares) - self._pending
        if missing > 0:
            self.send(ZygoteRequest(spares=missing))
            self._pending += missing

    def _receive_offer(self, timeout: float) -> None:
        fds = array.array("i")
        try:
            readable, _, _ = select.select([self.sock], [], [], timeout)
            if not readable:
                return
            message, ancillary, _flags, _address = self.sock.recvmsg(
                MAX_MESSAGE_BYTES, socket.CMSG_SPACE(OFFER_FD_COUNT * fds.itemsize)
            )
        except (OSError, ValueError) as exc:
            raise _ZygoteLost(f"its control socket failed ({exc})") from exc
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if not message:
            raise _ZygoteLost("it closed its control socket")
        if len(fds) != OFFER_FD_COUNT:
            for fd in fds:
                os.close(fd)
            raise _ZygoteLost("it sent a malformed spare offer")
        offer = SpareOffer.model_validate_json(message)
        self._pending = max(0, self._pending - 1)
        self._spares.append(
            _Spare(
                offer.pid,
                offer.generation,
                socket.socket(fileno=fds[0]),
                socket.socket(fileno=fds[1]),
            )
        )


class ZygoteCall:
    """The worker's side of one call running in a zygote child.

    The child is not the worker's child: its exit and wait status arrive on the call's status
    socket, after the zygote has killed what was left of the child's process group.
    """

    def __init__(
        self,
        client: ZygoteClient,
        connection: _Connection,
        sock: socket.socket,
        pid: int,
    ) -> None:
        self._client = client
        self._connection = connection
        self._sock = sock
        self.pid = pid
        self.wait_status: int | None = None
        self.end_detail: str | None = None
        self.prepared: Preparation | None = None
        """What the spare was prepared with (its workdir and cgroup are the call's)."""
        self.refill: tuple[bytes, Callable[[], Preparation]] | None = None
        """The profile key and preparation of the spares to confine once the call is over."""
        sock.setblocking(False)

    @property
    def exit_fd(self) -> int:
        """Readable when the zygote reports the child's end (or the zygote is gone)."""
        return self._sock.fileno()

    @property
    def ended(self) -> bool:
        return self.wait_status is not None or self.end_detail is not None

    def poll_exit(self) -> bool:
        """Take the zygote's report if there is one; True once the child's end is known."""
        if self.ended:
            return True
        try:
            data = self._sock.recv(MAX_MESSAGE_BYTES)
        except BlockingIOError:
            return False
        except OSError as exc:
            data = b""
            self.end_detail = f"the call's zygote socket failed: {exc}"
        if not data:
            self.end_detail = self.end_detail or (
                "the sandbox zygote ended during the call; the child was killed with it"
            )
            self._client.lost(self._connection, "it ended during a call")
            return True
        try:
            self.wait_status = ZygoteReply.model_validate_json(data).status
        except ValueError:
            self.end_detail = "the sandbox zygote sent an unreadable report"
        return True

    def reap(self, block: bool) -> bool:
        """Wait (when `block`, for at most REAP_SECONDS) for the child's end; True once known."""
        if self.poll_exit() or not block:
            return self.ended
        readable, _, _ = select.select([self._sock], [], [], REAP_SECONDS)
        if not (readable and self.poll_exit()):
            self.end_detail = f"the sandbox zygote did not report the child's end within {REAP_SECONDS:g} s"
        return True

    def kill_group(self, signum: int) -> None:
        """Signal the child's process group, unless the zygote already reaped the child (and
        killed the group): its id may no longer be the child's."""
        if self.ended:
            return
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def release(self) -> None:
        """The call is over: the zygote reaps the child on its own, and the spares it used up
        are asked for and confined in the background, for calls of the same profile."""
        self._sock.close()
        refill, self.refill = self.refill, None
        if refill is not None:
            self._client.refill_later(self._connection, *refill)


class ZygoteClient:
    """Starts and restarts the zygote of this process and hands calls to its spares. Thread-safe."""

    def __init__(self, modules: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._modules: set[str] = set(modules) | set(_configured_modules())
        self._connection: _Connection | None = None
        self._deaths: list[float] = []
        self._paused_reason: str | None = None
        # The zygote's parent-death signal fires when the *thread* that started it ends, so it is
        # started from a thread that lives as long as this process.
        self._starter = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="toolchord-zygote"
        )
        self._preparer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="toolchord-spares"
        )
        self._stops_at_exit = False

    @property
    def pid(self) -> int | None:
        """The running zygote's pid, if there is one."""
        connection = self._connection
        return connection.pid if connection is not None and connection.alive() else None

    def owned_here(self) -> bool:
        """False in a process forked from the one that made this client."""
        return self._owner_pid == os.getpid()

    def ensure_started(self) -> bool:
        """Start the zygote unless it runs; False when it cannot run now (the reason is logged)."""
        try:
            self._running()
        except ZygoteUnavailable:
            return False
        return True

    def add_modules(self, modules: Iterable[str]) -> None:
        """Tool modules to import in zygotes started from now on."""
        with self._lock:
            self._modules.update(modules)

    def submit(
        self,
        locator: ToolLocator,
        payload: Callable[[Preparation | None], bytes],
        child_fds: tuple[int, int, int],
        profile_key: bytes = b"",
        prepare: Callable[[], Preparation] | None = None,
    ) -> ZygoteCall:
        """Hand one call to a spare child of the zygote and return the running call.

        `payload` gives the call's payload for the spare it is handed to, from what that spare
        was prepared with (None: nothing, the call brings its own workdir and cgroup); a spare
        prepared for another `profile_key` is let go. The running call's `prepared` is then the
        call's to release. With `prepare`, the spares are confined for `profile_key` when the
        call is released (the next call most likely has the same profile). Raises
        ZygoteUnavailable when the zygote cannot run now or was lost before the call reached a
        child (the call did not run; the next call starts a new zygote), and ZygoteToolError
        when the zygote cannot load the tool.
        """
        connection = self._running()
        key = locator.model_dump_json().encode()
        try:
            generation = connection.loaded.get(key)
            if generation is None:
                generation = connection.load(locator, key)
            # A spare that died while waiting (killed by another call of the same user) refuses
            # the call: the next one is tried, a fresh one is offered within REPLY_SECONDS.
            for _ in range(SPARES + 1):
                spare = connection.take_spare(generation, profile_key)
                try:
                    # Failures here (no workdir, no memfd) are the worker's, not the spare's.
                    memfd = os.memfd_create("toolchord-call", os.MFD_CLOEXEC)
                    try:
                        _write_all(memfd, payload(spare.prepared))
                    except BaseException:
                        os.close(memfd)
                        raise
                except BaseException:
                    spare.close()
                    raise
                try:
                    spare.call.sendmsg(
                        [key],
                        [
                            (
                                socket.SOL_SOCKET,
                                socket.SCM_RIGHTS,
                                array.array("i", [*child_fds, memfd]),
                            )
                        ],
                    )
                except OSError as exc:
                    os.close(memfd)
                    spare.close()
                    if not connection.alive():
                        raise _ZygoteLost(
                            "it ended before a call reached its child"
                        ) from exc
                    _log.warning(
                        "sandbox zygote spare child %d could not take a call (%s); trying another",
                        spare.pid,
                        exc,
                    )
                    continue
                except BaseException:
                    os.close(memfd)
                    spare.close()
                    raise
                os.close(memfd)
                spare.call.close()
                call = ZygoteCall(self, connection, spare.status, spare.pid)
                call.prepared, spare.prepared = spare.prepared, None
                if prepare is not None:
                    call.refill = (profile_key, prepare)
                return call
            raise _ZygoteLost(f"{SPARES + 1} spare children in a row refused a call")
        except _ZygoteLost as exc:
            self.lost(connection, str(exc))
            raise ZygoteUnavailable(
                f"the sandbox zygote was lost before the call reached a child: {exc}"
            ) from exc

    def refill_later(
        self, connection: _Connection, profile_key: bytes, prepare: Callable[[], Preparation]
    ) -> None:
        """From a background thread: have the spares a call used up replaced, and the spares on
        offer confined ahead of their calls for calls of `profile_key`."""
        if self._connection is not connection:
            return  # lost or stopped meanwhile: the next call starts a new zygote
        if not self._stops_at_exit:
            # Registered after the workdir and cgroup modules' own exit hooks, so it runs before
            # them: the spares' workdirs and cgroups are released, then removed.
            atexit.register(self.stop)
            self._stops_at_exit = True
        self._preparer.submit(connection.refill, profile_key, prepare).add_done_callback(
            _log_preparation_failure
        )

    def lost(self, connection: _Connection, reason: str) -> None:
        """Forget a zygote that died or stopped answering; the next call starts a new one."""
        with self._lock:
            if self._connection is not connection:
                return  # already handled by another thread
            self._connection = None
            self._deaths.append(time.monotonic())
        connection.kill()
        _log.warning(
            "sandbox zygote (pid %d) lost: %s (%s); it is restarted on the next call",
            connection.pid,
            reason,
            connection.describe_end(),
        )

    def stop(self) -> None:
        """Stop the zygote (it is started again on the next call)."""
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.kill()

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's zygote without touching it."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.abandon()

    def _running(self) -> _Connection:
        """The running zygote, started if need be; raises ZygoteUnavailable when it cannot run."""
        with self._lock:
            connection = self._connection
            if connection is not None and not connection.alive():
                self._connection = None
                self._deaths.append(time.monotonic())
                _log.warning(
                    "sandbox zygote (pid %d) %s; starting a new one",
                    connection.pid,
                    connection.describe_end(),
                )
                connection.kill()
                connection = None
            if connection is not None:
                return connection
            now = time.monotonic()
            self._deaths = [t for t in self._deaths if now - t < DEATH_WINDOW_SECONDS]
            if len(self._deaths) > DEATHS_ALLOWED:
                resume = self._deaths[0] + DEATH_WINDOW_SECONDS - now
                self._pause(
                    f"it died or failed to start {len(self._deaths)} times within "
                    f"{DEATH_WINDOW_SECONDS:g} s; next start in {resume:.0f} s"
                )
            try:
                connection = self._starter.submit(self._start).result()
            except (OSError, ValueError, RuntimeError) as exc:
                self._deaths.append(time.monotonic())
                self._pause(f"it could not start: {type(exc).__name__}: {exc}")
            self._paused_reason = None
            self._connection = connection
            return connection

    def _pause(self, reason: str) -> NoReturn:
        """Refuse the call: isolated calls fail (never fork the worker) until a zygote runs."""
        if self._paused_reason is None:
            _log.error(
                "sandbox zygote unavailable in this worker process (%s): isolated calls fail "
                "until it runs again",
                reason,
            )
        self._paused_reason = reason
        raise ZygoteUnavailable(f"the sandbox zygote is unavailable: {reason}")

    def _start(self) -> _Connection:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-c", BOOTSTRAP, str(theirs.fileno())],
                env={
                    name: os.environ[name] for name in ENV_ALLOW if name in os.environ
                },
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                close_fds=True,
                # Not in the worker's process group: a Ctrl-C meant for the worker's warm shutdown
                # must not kill calls that are still running.
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        cwd = os.getcwd()
        init = ZygoteInit(
            sys_path=[os.path.abspath(p) if p else cwd for p in sys.path],
            parent_pid=os.getpid(),
            modules=sorted(self._modules),
            spares=SPARES,
            # Calls of an unprivileged worker keep its uid: only a namespace of their own keeps
            # them from signalling the zygote and the worker where Landlock cannot scope signals.
            pid_namespace=os.geteuid() != 0,
        )
        connection = _Connection(process, ours, process.pid)
        try:
            ours.settimeout(START_SECONDS)
            ours.send(init.model_dump_json().encode())
            raw = ours.recv(MAX_MESSAGE_BYTES)
            if not raw:
                process.wait(REAP_SECONDS)
                raise RuntimeError(
                    f"the zygote {connection.describe_end()} while starting"
                )
            ready = ZygoteReady.model_validate_json(raw)
            # Sends block when the zygote's queue is full; a wedged zygote must not hang the worker.
            ours.settimeout(REPLY_SECONDS)
        except BaseException:
            connection.kill()
            raise
        connection.expect_spares(SPARES)
        # In a pid namespace the serving zygote is a child of the process started here.
        connection.pid = ready.pid
        if ready.pid_namespace is not None:
            _log.warning(
                "sandbox zygote serves without a pid namespace of its own (%s): where Landlock "
                "cannot scope signals (ABI < 6), calls of this unprivileged worker can signal "
                "the zygote and the worker",
                ready.pid_namespace,
            )
        if ready.call_pid_namespaces is not None:
            _log.warning(
                "sandbox zygote cannot give each call a pid namespace of its own (%s): where "
                "Landlock cannot scope signals (ABI < 6), calls of this unprivileged worker "
                "process can signal each other",
                ready.call_pid_namespaces,
            )
        for module, error in ready.failed_modules.items():
            _log.warning(
                "tool module %s cannot be imported in the sandbox zygote (%s); its tools run in "
                "a direct fork of the worker",
                module,
                error,
            )
        in_namespace = init.pid_namespace and ready.pid_namespace is None
        _log.info(
            "sandbox zygote started (pid %d%s)",
            ready.pid,
            ", in a pid namespace of its own" if in_namespace else "",
        )
        return connection


def _log_preparation_failure(done: Future[None]) -> None:
    """Spares that could not be confined ahead leave their calls to confine themselves: say why."""
    error = done.exception()
    if error is not None:
        _log.warning("sandbox spares could not be confined ahead of their calls: %s: %s",
                     type(error).__name__, error)


def _configured_modules() -> list[str]:
    raw = os.environ.get("TOOLCHORD_TOOL_MODULES", "")
    return [name.strip() for name in raw.split(",") if name.strip()]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def locate(spec: ToolSpec) -> ToolLocator | None:
    """Where the zygote can find this tool by importing its module, or None (direct fork).

    The tool must be a module-level ToolSpec, or belong to a module-level Registry, of a module
    importable by name (not `__main__`, not defined inside a function), and share the handler,
    argument model and exception policy with `spec`; the sandbox profile and timeout travel
    with each call, so `spec.model_copy(update={"sandbox": ...})` variants qualify.
    """
    cached = _locations.get(id(spec))
    if cached is not None and cached[0] is spec:
        return cached[1]
    location = _find(spec)
    with _locations_lock:
        if len(_locations) >= LOCATIONS_KEPT:
            # Specs made per call (model_copy variants) must not accumulate.
            _locations.clear()
        _locations[id(spec)] = (spec, location)
    return location


LOCATIONS_KEPT = 1024
_locations: dict[int, tuple[ToolSpec, ToolLocator | None]] = {}
_locations_lock = threading.Lock()


def _find(spec: ToolSpec) -> ToolLocator | None:
    module_name = getattr(spec.handler, "__module__", None)
    if not module_name or module_name == "__main__":
        return None
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__spec__", None) is None:
        return None
    members = list(vars(module).items())
    for attribute, value in members:
        if isinstance(value, ToolSpec) and _same_tool(value, spec):
            return ToolLocator(module=module_name, attribute=attribute)
    for attribute, value in members:
        if isinstance(value, Registry):
            for candidate in value:
                if _same_tool(candidate, spec):
                    return ToolLocator(
                        module=module_name,
                        attribute=attribute,
                        registry_tool=candidate.name,
                    )
    return _function_locator(spec, module_name, module)


def _function_locator(
    spec: ToolSpec, module_name: str, module: object
) -> ToolLocator | None:
    """A `tool(fn)` wrap of a module-level function (made in `__main__`, in a function, or under
    another name): the zygote wraps the same function again, which gives the same tool as long
    as the spec's argument handling is the one `tool(fn)` derives from the function."""
    qualname = getattr(spec.handler, "__qualname__", "")
    if not qualname or "<locals>" in qualname:
        return None
    found: object = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if isinstance(found, ToolSpec):
        found = found.handler  # `tool(other_tool.handler, ...)`: the decorated function again
    if found is not spec.handler:
        return None
    try:
        rebuilt = tool(spec.handler, name=spec.name)
    except (TypeError, ValueError, NameError):
        return None
    if not _same_arguments(rebuilt, spec):
        return None
    return ToolLocator(module=module_name, attribute=qualname, function_tool=spec.name)


def _same_arguments(rebuilt: ToolSpec, spec: ToolSpec) -> bool:
    """`spec` handles arguments and exceptions as `tool(handler)` does: its model is the same
    class (a model parameter), or one generated from the same signature (no validators of its own)."""
    if (
        rebuilt.unpack_args != spec.unpack_args
        or rebuilt.context_param != spec.context_param
        or rebuilt.transient != spec.transient
    ):
        return False
    if rebuilt.args_model is spec.args_model:
        return True
    # Models `tool()` generates from a signature belong to the module that defines ToolSpec.
    return (
        spec.args_model.__module__ == rebuilt.args_model.__module__ == ToolSpec.__module__
        and spec.args_model.model_json_schema() == rebuilt.args_model.model_json_schema()
    )


def _same_tool(found: ToolSpec, spec: ToolSpec) -> bool:
    return (
        found.handler is spec.handler
        and found.args_model is spec.args_model
        and found.unpack_args == spec.unpack_args
        and found.context_param == spec.context_param
        and found.transient == spec.transient
    )


_client: ZygoteClient | None = None
_client_lock = threading.Lock()
_enabled: bool | None = None


def zygote_enabled() -> bool:
    """Whether isolated calls go through the zygote (TOOLCHORD_SANDBOX_ZYGOTE, default on)."""
    if _enabled is not None:
        return _enabled
    return os.environ.get(ZYGOTE_ENV, "1").strip().lower() not in (
        "0",
        "false",
        "off",
        "no",
    )


def set_zygote_enabled(enabled: bool | None) -> None:
    """Force the zygote on or off in this process (None: follow TOOLCHORD_SANDBOX_ZYGOTE)."""
    global _enabled
    _enabled = enabled


def zygote_client() -> ZygoteClient:
    """This process's zygote client (a forked process gets a fresh one)."""
    global _client
    with _client_lock:
        if _client is None or not _client.owned_here():
            _client = ZygoteClient()
        return _client


def start_zygote(modules: Iterable[str] = (), *, wait: bool = True) -> int | None:
    """Start this process's zygote now, importing `modules` and TOOLCHORD_TOOL_MODULES.

    Call it at Celery's `worker_process_init` so the first call does not pay the start (a few
    hundred milliseconds, more with heavy tool modules). With `wait=False` it starts in the
    background and returns None at once (calls made meanwhile wait for it): a pool child must
    report to Celery within `worker_proc_alive_timeout`. Otherwise returns the zygote's pid, or
    None when it could not start (isolated calls then fail until it can; the reason is logged).
    """
    if not zygote_enabled():
        return None
    client = zygote_client()
    client.add_modules(modules)
    if not wait:
        threading.Thread(
            target=client.ensure_started, name="toolchord-zygote-start", daemon=True
        ).start()
        return None
    return client.pid if client.ensure_started() else None


def stop_zygote() -> None:
    """Stop this process's zygote, if any; the next isolated call starts a new one."""
    if _client is not None and _client.owned_here():
        _client.stop()


def zygote_pid() -> int | None:
    """The pid of this process's running zygote, or None."""
    if _client is None or not _client.owned_here():
        return None
    return _client.pid


def _after_fork_in_child() -> None:
    # A forked process must not keep the parent's control socket open: the parent's zygote would
    # then not see end of file when the parent dies.
    if _client is not None:
        _client.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
