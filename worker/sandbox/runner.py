"""Run one tool call in a sandboxed child process of the worker and turn its end into an outcome.

The child is an `os.fork` of the worker process (a Celery prefork pool child, or the embedded
in-process worker): no new interpreter starts, the tool modules are already imported, and a call
costs a few milliseconds. stdlib `multiprocessing` is not used because it refuses to start children
from daemonic pool processes.

Residual risk of forking: the child starts with a copy of the worker's memory, so anything the
worker holds in Python objects (broker URL with its password in the Celery config, API clients,
caches) is in the child's address space too. The child clears `os.environ`, zeroes the original
environment and argument strings, closes every inherited descriptor (broker and Redis sockets),
drops to an unprivileged uid (so /proc/<worker>/environ and the worker's memory are unreadable),
and Landlock hides /proc; but a hostile handler could still read secrets out of its own copy of
the heap with ctypes. Workers that load secrets into memory and run untrusted handlers need a
zygote (a clean interpreter started with an empty environment that forks per call) or a separate
worker process without those secrets; see docs/sandbox.md.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from pydantic import BaseModel

from worker.context import ToolContext
from worker.execution import HandlerOutcome, call_handler
from worker.sandbox.capabilities import LAYERS, SandboxCapabilities, probe
from worker.sandbox.child import (
    RESULT_HEADER_BYTES,
    RESULT_MAGIC,
    SETUP_FAILED_STATUS,
    ChildPlan,
    child_main,
)
from worker.sandbox.import_paths import private_import_roots
from worker.sandbox.limits import cpu_seconds
from worker.sandbox.profile import Layer, SandboxProfile
from worker.tools import ToolSpec

GRACE_SECONDS = 1.0
"""Time between SIGTERM and SIGKILL for the process group of a call that overran its timeout."""
OUTPUT_KEEP_BYTES = 1024 * 1024
"""Captured stdout/stderr kept per call; the rest is drained and counted."""
OUTPUT_FLOOD_BYTES = 16 * 1024 * 1024
"""Total stdout/stderr after which the call is killed as a flood."""
RESULT_MAX_BYTES = 16 * 1024 * 1024
"""Largest JSON outcome accepted from a child."""
CANCEL_POLL_SECONDS = 0.2
WORKDIR_ROOT_ENV = "TOOLCHORD_SANDBOX_DIR"

SYSTEM_READ_PATHS: tuple[str, ...] = (
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/bin",
    "/sbin",
    "/etc",
)
DEVICE_PATHS: tuple[str, ...] = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
)

_log = logging.getLogger("toolchord.sandbox")
_warned: set[str] = set()
_warned_lock = threading.Lock()
_read_paths_cache: tuple[int, tuple[str, ...]] | None = None
# Children that delivered their result and were killed but not yet reaped: waiting for the kernel
# to tear down a forked worker image costs a millisecond or more, so it happens off the call path.
_unreaped: set[int] = set()
_unreaped_lock = threading.Lock()


def requested_layers(profile: SandboxProfile) -> frozenset[Layer]:
    """The layers a profile asks for: always rlimits, uid and seccomp; Landlock for a confined
    filesystem or no network; a network namespace when the network is off."""
    layers: set[Layer] = {"rlimits", "uid", "seccomp"}
    if profile.filesystem == "confined" or not profile.network:
        layers.add("landlock")
    if not profile.network:
        layers.add("netns")
    return frozenset(layers)


def run_isolated(
    spec: ToolSpec,
    args: BaseModel,
    context: ToolContext,
    *,
    timeout: float | None = None,
) -> HandlerOutcome:
    """Run `call_handler(spec, args, context)` under the tool's sandbox profile. Never raises for
    anything the handler does; thread-safe.

    `timeout` defaults to `spec.timeout`. `context.workdir` is set to a fresh per-call directory,
    removed afterwards. With `spec.sandbox.isolate` False the handler runs in this process.
    """
    profile = spec.sandbox
    limit = spec.timeout if timeout is None else timeout
    try:
        if not profile.isolate:
            if profile.required:
                return _unavailable(
                    sorted(profile.required), "the tool runs in-process (isolate=False)"
                )
            return _run_in_process(spec, args, context)
        _reap_finished()
        caps = probe()
        missing_required = caps.missing(profile.required)
        if missing_required:
            return _unavailable(
                missing_required,
                "; ".join(caps.status(m).detail for m in missing_required),
            )
        for layer in caps.missing(requested_layers(profile)):
            _warn_once(layer, caps)
        return _supervise(spec, args, context, limit, caps)
    except OSError as exc:
        # fork, pipe or mkdtemp failed: the worker is short of resources, the handler never ran.
        return HandlerOutcome(
            status="error",
            started=False,
            error_type="SandboxError",
            error_message=f"could not start the sandbox: {type(exc).__name__}: {exc}",
        )


def _unavailable(layers: list[Layer], reason: str) -> HandlerOutcome:
    return HandlerOutcome(
        status="error",
        started=False,
        error_type="SandboxUnavailable",
        error_message=f"required sandbox layer(s) unavailable: {', '.join(layers)} ({reason})",
    )


def _warn_once(layer: Layer, caps: SandboxCapabilities) -> None:
    with _warned_lock:
        if layer in _warned:
            return
        _warned.add(layer)
    _log.warning(
        "sandbox layer %s requested but unavailable: %s",
        layer,
        caps.status(layer).detail,
    )


def _run_in_process(
    spec: ToolSpec, args: BaseModel, context: ToolContext
) -> HandlerOutcome:
    workdir = _make_workdir()
    try:
        return call_handler(spec, args, context.model_copy(update={"workdir": workdir}))
    finally:
        _remove_tree(workdir)


def _make_workdir() -> str:
    root = os.environ.get(WORKDIR_ROOT_ENV) or tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="toolchord-call-", dir=root)


def _reap_finished() -> None:
    with _unreaped_lock:
        for pid in list(_unreaped):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                _unreaped.discard(pid)


def _remove_tree(path: str) -> None:
    def make_writable(
        function: Callable[..., object], failed: str, _exc: BaseException
    ) -> None:
        # A handler may leave read-only directories behind; the owner (or root) can fix the mode.
        os.chmod(os.path.dirname(failed), stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, stat.S_IRWXU)
        function(failed)

    try:
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=make_writable)
        else:
            shutil.rmtree(
                path,
                onerror=lambda function, failed, info: make_writable(
                    function, failed, info[1]
                ),
            )
    except OSError as exc:
        _log.warning("could not remove sandbox workdir %s: %s", path, exc)


def _read_paths(profile: SandboxProfile) -> tuple[str, ...]:
    """System directories, the interpreter and the code already imported (read-only in the child).

    The worker's current directory is not granted as a whole even when it is on sys.path (it is
    often the project root, next to configuration and .env files); the modules and packages
    imported from it are, one by one. Recomputed when new modules were imported.
    """
    global _read_paths_cache
    module_count = len(sys.modules)
    if _read_paths_cache is None or _read_paths_cache[0] != module_count:
        cwd = os.getcwd()
        paths = dict.fromkeys(SYSTEM_READ_PATHS)
        paths.update(dict.fromkeys((sys.prefix, sys.base_prefix, sys.exec_prefix)))
        paths.update(
            dict.fromkeys(
                p for p in (os.path.abspath(p) for p in sys.path if p) if p != cwd
            )
        )
        for name, module in list(sys.modules.items()):
            # Top-level modules found through path hooks (editable installs) or the current
            # directory: a package grants its directory, a single module only its file.
            origin = getattr(module, "__file__", None)
            if "." not in name and origin:
                origin = os.path.abspath(origin)
                is_package = os.path.basename(origin).startswith("__init__.")
                paths[os.path.dirname(origin) if is_package else origin] = None
        existing = sorted((p for p in paths if os.path.exists(p)), key=len)
        # A rule covers the whole subtree: nested entries only cost extra syscalls per call.
        kept: list[str] = []
        for path in existing:
            if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
                kept.append(path)
        _read_paths_cache = (module_count, tuple(kept))
    return (*_read_paths_cache[1], *profile.read_paths)


def _supervise(
    spec: ToolSpec,
    args: BaseModel,
    context: ToolContext,
    limit: float,
    caps: SandboxCapabilities,
) -> HandlerOutcome:
    workdir = _make_workdir()
    watch: _Watch | None = None
    try:
        watch = _start(spec, args, context, limit, workdir, caps)
        return watch.outcome(_planned_layers(spec.sandbox, caps))
    finally:
        _clean_up(watch, workdir)


def _clean_up(watch: _Watch | None, workdir: str) -> None:
    """Remove the workdir; reap the child now only if it has to be gone first."""
    if watch is None or watch.wait_status is not None:
        _remove_tree(workdir)
        return
    try:
        shutil.rmtree(workdir)
    except OSError:
        # A killed grandchild may still have been finishing a write: remove once the group is gone.
        watch.reap(0)
        _remove_tree(workdir)
    else:
        with _unreaped_lock:
            _unreaped.add(watch.pid)


def _planned_layers(profile: SandboxProfile, caps: SandboxCapabilities) -> list[str]:
    """Layers the child was set up to apply; reported when it ends without saying (timeout, crash)."""
    available = caps.available()
    return [
        layer
        for layer in LAYERS
        if layer in available and (layer != "netns" or not profile.network)
    ]


def _start(
    spec: ToolSpec,
    args: BaseModel,
    context: ToolContext,
    limit: float,
    workdir: str,
    caps: SandboxCapabilities,
) -> _Watch:
    profile = spec.sandbox
    available = caps.available()
    drop_uid = "uid" in available
    seccomp_program = None
    if "seccomp" in available:
        from worker.sandbox.seccomp_filter import compile_filter

        seccomp_program = compile_filter(network=profile.network)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    res_r, res_w = os.pipe2(os.O_CLOEXEC)
    ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
    plan = ChildPlan(
        spec=spec,
        args=args,
        context=context,
        timeout=limit,
        workdir=workdir,
        output_fd=out_w,
        result_fd=res_w,
        control_fd=ctl_r,
        parent_pid=os.getpid(),
        drop_uid=drop_uid,
        netns=not profile.network and "netns" in available,
        landlock_abi=caps.landlock_abi if "landlock" in available else 0,
        read_paths=_read_paths(profile),
        write_paths=(*DEVICE_PATHS, *profile.write_paths),
        seccomp_program=seccomp_program,
        import_roots=private_import_roots() if drop_uid else (),
        required=profile.required,
    )
    started = time.monotonic()
    try:
        pid = os.fork()
    except OSError:
        for fd in (out_r, out_w, res_r, res_w, ctl_r, ctl_w):
            os.close(fd)
        raise
    if pid == 0:
        child_main(plan)
    for fd in (out_w, res_w, ctl_r):
        os.close(fd)
    watch = _Watch(pid, out_r, res_r, ctl_w, spec, context, limit, started)
    try:
        watch.run()
    finally:
        for fd in (out_r, res_r, ctl_w):
            os.close(fd)
    return watch


class _Watch:
    """The worker side of one child: collect its pipes, enforce the deadline, reap it."""

    def __init__(
        self,
        pid: int,
        out_fd: int,
        result_fd: int,
        control_fd: int,
        spec: ToolSpec,
        context: ToolContext,
        limit: float,
        started: float,
    ) -> None:
        self.pid = pid
        self.out_fd = out_fd
        self.result_fd = result_fd
        self.control_fd = control_fd
        self.spec = spec
        self.context = context
        self.limit = limit
        self.started = started
        self.deadline = started + limit
        self.output = bytearray()
        self.output_total = 0
        self.result = bytearray()
        self.result_complete = False
        self.kill_reason: tuple[str, str] | None = None
        self.timed_out = False
        self.cancelled = False
        self.term_at: float | None = None
        self.cancel_seen_at: float | None = None
        self.wait_status: int | None = None
        os.set_blocking(out_fd, False)
        os.set_blocking(result_fd, False)

    def run(self) -> None:
        try:
            pidfd: int | None = os.pidfd_open(self.pid)
        except OSError:
            pidfd = None  # kernels before 5.3: poll waitpid instead
        poller = select.poll()
        open_fds = {self.out_fd, self.result_fd}
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        next_cancel_poll = self.started + CANCEL_POLL_SECONDS
        try:
            while True:
                now = time.monotonic()
                self._enforce_deadline(now)
                if now >= next_cancel_poll:
                    self._check_cancel(now)
                    next_cancel_poll = now + CANCEL_POLL_SECONDS
                wake = min(self._next_deadline(), next_cancel_poll)
                wait_ms = max(0, int((wake - now) * 1000) + 1)
                if pidfd is None:
                    wait_ms = min(wait_ms, 20)
                exited = False
                for fd, _events in poller.poll(wait_ms):
                    if fd == pidfd:
                        exited = True
                    elif not self._read(fd):
                        poller.unregister(fd)
                        open_fds.discard(fd)
                if pidfd is None:
                    exited = self.reap(os.WNOHANG)
                if exited or self.result_complete:
                    break
            # Kill what is left of the group (grandchildren, or the child that is about to exit
            # after its result) while the leader, alive or zombie, still holds the group id; then
            # take what was written before.
            self._killpg(signal.SIGKILL)
            for fd in open_fds:
                while self._read(fd):
                    pass
            if exited and self.wait_status is None:
                self.reap(0)
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _next_deadline(self) -> float:
        if self.term_at is not None:
            return self.term_at + GRACE_SECONDS
        if self.cancel_seen_at is not None and self.spec.cancellable:
            return min(self.deadline, self.cancel_seen_at + GRACE_SECONDS)
        return self.deadline

    def _enforce_deadline(self, now: float) -> None:
        if self.term_at is None:
            cancel_expired = (
                self.spec.cancellable
                and self.cancel_seen_at is not None
                and now >= self.cancel_seen_at + GRACE_SECONDS
            )
            if cancel_expired:
                self.cancelled = True
                # A cancelled call had its grace period already: no SIGTERM round.
                self.term_at = now - GRACE_SECONDS
                self._killpg(signal.SIGKILL)
            elif now >= self.deadline and self.kill_reason is None:
                self.timed_out = True
                self.term_at = now
                self._killpg(signal.SIGTERM)
        elif now >= self.term_at + GRACE_SECONDS:
            self._killpg(signal.SIGKILL)

    def _check_cancel(self, now: float) -> None:
        if self.cancel_seen_at is not None:
            return
        try:
            cancelled = self.context.cancelled
        except Exception:  # noqa: BLE001 - a broken cancel check must not break the call
            cancelled = False
        if cancelled:
            self.cancel_seen_at = now
            try:
                os.write(self.control_fd, b"c")
            except OSError:
                pass

    def _read(self, fd: int) -> bool:
        """Read one chunk; False at end of file or when nothing is available."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            return False
        if fd == self.out_fd:
            self.output_total += len(chunk)
            room = OUTPUT_KEEP_BYTES - len(self.output)
            if room > 0:
                self.output += chunk[:room]
            if self.output_total > OUTPUT_FLOOD_BYTES and self.kill_reason is None:
                self._stop(
                    "OutputLimitExceeded",
                    f"stdout/stderr exceeded {OUTPUT_FLOOD_BYTES} bytes",
                )
        elif self.kill_reason is None and not self.result_complete:
            self.result += chunk
            self._check_frame()
        return True

    def _check_frame(self) -> None:
        if len(self.result) < RESULT_HEADER_BYTES:
            return
        if not self.result.startswith(RESULT_MAGIC):
            return  # garbage: reported once the child has ended
        declared = int.from_bytes(
            self.result[len(RESULT_MAGIC) : RESULT_HEADER_BYTES], "big"
        )
        if declared > RESULT_MAX_BYTES:
            self._stop(
                "ResultTooLarge",
                f"result exceeded {RESULT_MAX_BYTES} bytes ({declared} bytes)",
            )
        elif len(self.result) >= RESULT_HEADER_BYTES + declared:
            self.result_complete = True
        if len(self.result) > RESULT_HEADER_BYTES + RESULT_MAX_BYTES:
            self._stop(
                "ChildProtocolError",
                f"child wrote more than {RESULT_MAX_BYTES} bytes to the result pipe",
            )

    def _stop(self, error_type: str, message: str) -> None:
        self.kill_reason = (error_type, message)
        self._killpg(signal.SIGKILL)

    def _killpg(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self, flags: int) -> bool:
        """waitpid with flags; True once the child's status is known (or lost to another reaper)."""
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:
            # Reaped elsewhere (a SIGCHLD handler): the status is lost.
            self.wait_status = -1
            return True
        if pid == 0:
            return False
        self.wait_status = status
        return True

    def outcome(self, planned_layers: list[str]) -> HandlerOutcome:
        """How the call ended, with the captured output."""
        output = self.output.decode("utf-8", "replace")
        if self.output_total > len(self.output):
            output += f"\n[toolchord: {self.output_total - len(self.output)} more bytes of output dropped]"
        if self.result_complete and not (
            self.kill_reason or self.timed_out or self.cancelled
        ):
            body = bytes(self.result[RESULT_HEADER_BYTES:])
            try:
                reported = HandlerOutcome.model_validate_json(body)
            except ValueError as exc:
                outcome = self._protocol_error(type(exc).__name__, body)
            else:
                reported.output = output
                return reported
        else:
            outcome = self._parent_verdict()
        # The child did not report, or its report does not count: describe what was set up.
        outcome.output = output
        outcome.duration_ms = (time.monotonic() - self.started) * 1000
        outcome.sandbox_layers = planned_layers
        return outcome

    def _parent_verdict(self) -> HandlerOutcome:
        if self.kill_reason is not None:
            error_type, message = self.kill_reason
            return HandlerOutcome(
                status="crashed", error_type=error_type, error_message=message
            )
        if self.timed_out:
            return HandlerOutcome(
                status="timeout",
                error_type="TimeoutError",
                error_message=(
                    f"handler did not finish within its {self.limit:g} s timeout; its process group was killed"
                ),
            )
        if self.cancelled:
            return HandlerOutcome(
                status="cancelled",
                error_type="Cancelled",
                error_message="the call was cancelled while running; its process group was killed",
            )
        if self.result:
            reason = (
                "an incomplete result frame"
                if self.result.startswith(RESULT_MAGIC)
                else "not a result frame"
            )
            return self._protocol_error(
                f"{reason}; {self._death_message()}", bytes(self.result)
            )
        return HandlerOutcome(
            status="crashed",
            error_type="ChildCrashed",
            error_message=self._death_message(),
        )

    @staticmethod
    def _protocol_error(reason: str, raw: bytes) -> HandlerOutcome:
        excerpt = raw[:200].decode("utf-8", "replace")
        return HandlerOutcome(
            status="crashed",
            error_type="ChildProtocolError",
            error_message=f"child returned an unreadable result ({len(raw)} bytes, {reason}): {excerpt!r}",
        )

    def _death_message(self) -> str:
        status = self.wait_status
        if status is None or status < 0:
            return "child ended without a result (exit status unavailable)"
        if os.WIFSIGNALED(status):
            signum = os.WTERMSIG(status)
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = f"signal {signum}"
            message = f"child killed by signal {signum} ({name})"
            if signum == signal.SIGXCPU:
                message += f": CPU time limit of {cpu_seconds(self.spec.sandbox, self.limit)} s exceeded"
            elif signum == signal.SIGKILL:
                message += " (not by the sandbox: the handler itself, the kernel's OOM killer or another process)"
            return message
        code = os.WEXITSTATUS(status)
        if code == SETUP_FAILED_STATUS:
            return f"child exited with status {code}: sandbox setup failed before the result pipe was ready"
        return f"child exited with status {code} without a result"
