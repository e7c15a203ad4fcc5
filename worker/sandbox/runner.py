"""Run one tool call in a sandboxed child process and turn its end into an outcome.

The child is forked by this worker process's zygote (`toolchord.worker.sandbox.zygote`): a clean
interpreter started with an allow-listed environment that imports only the tool modules, so the
child's memory holds none of the worker's secrets, and forking it is cheaper than forking a large
worker. Tools the zygote cannot import by name (defined in `__main__` or inside a function) or
load, and every call with the zygote switched off (TOOLCHORD_SANDBOX_ZYGOTE=0), run in a direct
`os.fork` of the worker instead, with a warning (stdlib `multiprocessing` is not used: it refuses
to start children from daemonic pool processes). A call whose zygote is down fails unrun
(`SandboxUnavailable`, transient, started=False) rather than fall back to a fork of the worker.
Both children apply the same layers (`toolchord.worker.sandbox.child`) and the worker watches both the same
way: output and result pipes, wall deadline, process-group kill.

Residual risk of the direct fork: the child starts with a copy of the worker's memory, so
anything the worker holds in Python objects (broker URL with its password in the Celery config,
API clients, caches) is in the child's address space. The child clears `os.environ`, zeroes the
original environment and argument strings, closes every inherited descriptor, drops to an
unprivileged uid and Landlock hides /proc; but a hostile handler could still read secrets out of
its own copy of the heap with ctypes. See docs/sandbox.md.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from toolchord.worker.context import ToolContext
from toolchord.worker.execution import HandlerOutcome, call_handler
from toolchord.worker.sandbox import cgroup
from toolchord.worker.sandbox.capabilities import LAYERS, SandboxCapabilities, probe
from toolchord.worker.sandbox.child import (
    LAYERS_MARK,
    LAYERS_MARK_BYTES,
    RESULT_HEADER_BYTES,
    RESULT_MAGIC,
    SETUP_FAILED_STATUS,
    START_MARK,
    ChildPlan,
    child_main,
    decode_layers,
)
from toolchord.worker.sandbox.disk import secret_directories
from toolchord.worker.sandbox.import_paths import private_import_roots
from toolchord.worker.sandbox.limits import cpu_seconds
from toolchord.worker.sandbox.profile import DirectFork, Layer, SandboxProfile
from toolchord.worker.sandbox.read_paths import DEVICE_PATHS, code_read_paths
from toolchord.worker.sandbox.scrub import secret_holders
from toolchord.worker.sandbox.workdir import (
    Workdir,
    configured_root_path,
    make_workdir,
    remove_workdir,
    remove_workdir_later,
    wait_for_removals,
)
from toolchord.worker.sandbox.zygote import (
    ZYGOTE_ENV,
    Preparation,
    ZygoteCall,
    ZygoteToolError,
    ZygoteUnavailable,
    locate,
    stop_zygote,
    zygote_client,
    zygote_enabled,
)
from toolchord.worker.sandbox.zygote_protocol import CallArguments, CallPayload, SpareLayers
from toolchord.worker.tools import ToolSpec

GRACE_SECONDS = 1.0
"""Time between SIGTERM and SIGKILL for the process group of a call that overran its timeout."""
OUTPUT_KEEP_BYTES = 1024 * 1024
"""Captured stdout/stderr kept per call; the rest is drained and counted."""
OUTPUT_FLOOD_BYTES = 16 * 1024 * 1024
"""Total stdout/stderr after which the call is killed as a flood."""
RESULT_MAX_BYTES = 16 * 1024 * 1024
"""Largest JSON outcome accepted from a child."""
CANCEL_POLL_SECONDS = 0.2

_log = logging.getLogger("toolchord.sandbox")
_warned: set[str] = set()
_warned_lock = threading.Lock()
# Children that delivered their result and were killed but not yet reaped: waiting for the kernel
# to tear down a forked worker image costs a millisecond or more, so it happens off the call path.
_unreaped: set[int] = set()
_unreaped_lock = threading.Lock()
_timings = False


def report_setup_timings(enabled: bool) -> None:
    """Benchmarks only: have children write when each setup step ended (child.TIMINGS_PREFIX) to
    their captured stderr, which is in the outcome's `output`."""
    global _timings
    _timings = enabled


def requested_layers(profile: SandboxProfile) -> frozenset[Layer]:
    """The layers a profile asks for: always rlimits, uid, seccomp, cgroup, disk and ipc; Landlock
    for a confined filesystem or no network; a network namespace when the network is off."""
    layers: set[Layer] = {"rlimits", "uid", "seccomp", "cgroup", "disk", "ipc"}
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
    direct_fork: DirectFork = "allow",
) -> HandlerOutcome:
    """Run `call_handler(spec, args, context)` under the tool's sandbox profile. Never raises for
    anything the handler does; thread-safe.

    `timeout` defaults to `spec.timeout`. `context.workdir` is set to a fresh per-call directory,
    removed afterwards. With `spec.sandbox.isolate` False the handler runs in this process.
    `direct_fork="refuse"` fails a call the zygote cannot run (`DirectForkRefused`, not started)
    instead of running it in a fork of this process, whose memory holds the worker's secrets.
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
        return _supervise(spec, args, context, limit, caps, direct_fork)
    except DirectForkRefused as exc:
        return HandlerOutcome(
            status="error",
            started=False,
            error_type="DirectForkRefused",
            error_message=str(exc),
        )
    except ZygoteUnavailable as exc:
        # Transient: the next call starts a new zygote, so the retry policy may try again.
        return HandlerOutcome(
            status="error",
            started=False,
            transient=True,
            error_type="SandboxUnavailable",
            error_message=f"{exc}; the call was not run",
        )
    except OSError as exc:
        # fork, pipe or mkdtemp failed: the worker is short of resources, the handler never ran.
        return HandlerOutcome(
            status="error",
            started=False,
            error_type="SandboxError",
            error_message=f"could not start the sandbox: {type(exc).__name__}: {exc}",
        )


def release_before_exit() -> None:
    """Stop this process's zygote and remove the workdirs and cgroups of its spares and of ended
    calls, as the process's exit hooks would: for a process that ends with `os._exit` (a Celery
    pool process), which skips them."""
    stop_zygote()
    wait_for_removals()
    cgroup.remove_at_exit()


def transient_type_names(spec: ToolSpec) -> frozenset[str]:
    """Names of the exception types the tool declared transient and of their subclasses known to
    this process: a child's error counts as transient when its type has one of these names (a
    handler can always raise such an error, so naming one grants it nothing more)."""
    names: set[str] = set()
    pending: list[type[BaseException]] = list(spec.transient)
    while pending:
        kind = pending.pop()
        if kind.__name__ not in names:
            names.add(kind.__name__)
            pending.extend(kind.__subclasses__())
    return frozenset(names)


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
    if spec.context_param is None:
        # Only a handler that takes its ToolContext can know the workdir: skip making one.
        return call_handler(spec, args, context)
    workdir = make_workdir()
    try:
        return call_handler(
            spec, args, context.model_copy(update={"workdir": workdir.path})
        )
    finally:
        remove_workdir(workdir)


def _reap_finished() -> None:
    with _unreaped_lock:
        for pid in list(_unreaped):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                _unreaped.discard(pid)


def _supervise(
    spec: ToolSpec,
    args: BaseModel,
    context: ToolContext,
    limit: float,
    caps: SandboxCapabilities,
    direct_fork: DirectFork,
) -> HandlerOutcome:
    resources = _CallResources(spec.sandbox, caps)
    watch: _Watch | None = None
    try:
        watch = _start(spec, args, context, limit, resources, direct_fork)
        used = resources.used
        return watch.outcome(
            _planned_layers(
                spec.sandbox, caps, with_cgroup=used is not None and used.cgroup is not None
            )
        )
    finally:
        resources.release(watch, mounted="disk" in caps.available())


@dataclass(frozen=True)
class _Held:
    """A workdir and a cgroup made for one call (or for a spare ahead of its call), and the layers
    planned with them."""

    workdir: Workdir
    cgroup: cgroup.CallCgroup | None
    layers: _Layers

    @classmethod
    def make(cls, profile: SandboxProfile, caps: SandboxCapabilities) -> _Held:
        workdir = make_workdir()
        call_cgroup = _make_cgroup(profile, caps)
        return cls(workdir, call_cgroup, _Layers.plan(profile, caps, call_cgroup, workdir.path))

    def spare_layers(self, profile: SandboxProfile) -> SpareLayers:
        """What a child applies with these, before the call's own part."""
        layers = self.layers
        return SpareLayers(
            profile=profile,
            workdir=self.workdir.path,
            drop_uid=layers.drop_uid,
            netns=layers.netns,
            landlock_abi=layers.landlock_abi,
            write_paths=layers.write_paths,
            seccomp_program=layers.seccomp_program.hex() if layers.seccomp_program else None,
            cgroup_join=layers.cgroup_join,
            disk_quota=layers.disk_quota,
            hidden_paths=layers.hidden_paths,
            ipc_namespace=layers.ipc_namespace,
            timings=_timings,
        )

    def release_later(self) -> None:
        """Of a spare let go before its call (it may have mounted its tmpfs on the workdir)."""
        if self.cgroup is not None:
            cgroup.release_later(self.cgroup)
        remove_workdir_later(self.workdir)


class _CallResources:
    """The workdir and cgroup of one call: those of the zygote spare that takes it when the spare
    was confined for them ahead of the call, else made for the call."""

    def __init__(self, profile: SandboxProfile, caps: SandboxCapabilities) -> None:
        self.profile = profile
        self.caps = caps
        self.own: _Held | None = None
        self.used: _Held | None = None

    def for_spare(self, prepared: Preparation | None) -> _Held:
        """What a spare prepared with `prepared` (None: not prepared) would run the call with."""
        if prepared is not None and isinstance(prepared.held, _Held):
            return prepared.held
        if self.own is None:
            self.own = _Held.make(self.profile, self.caps)
        return self.own

    def adopt(self, prepared: Preparation | None) -> _Held:
        """The call runs with these (a spare's, or its own): released after it."""
        self.used = self.for_spare(prepared)
        return self.used

    def release(self, watch: _Watch | None, mounted: bool) -> None:
        """After the call; the cgroup's processes were killed when it ended, so removing it need
        not delay the outcome."""
        used, own = self.used, self.own
        if used is not None:
            if used.cgroup is not None:
                cgroup.release_later(used.cgroup)
            _clean_up(watch, used.workdir, mounted)
        if own is not None and own is not used:
            # Made for the call, which then went to a prepared spare (or never started).
            if own.cgroup is not None:
                cgroup.release_later(own.cgroup)
            remove_workdir(own.workdir)


def _spare_key(profile: SandboxProfile, caps: SandboxCapabilities) -> bytes:
    """Which calls a spare confined ahead may run: those whose layers would be planned the same
    way (same profile, same capabilities of this host, same sandbox root for the workdir)."""
    global _caps_key
    if _caps_key is None or _caps_key[0] is not caps:
        _caps_key = (caps, caps.model_dump_json())  # holding caps keeps its id from being reused
    return "\n".join((profile.model_dump_json(), _caps_key[1], configured_root_path())).encode()


_caps_key: tuple[SandboxCapabilities, str] | None = None


def _preparation(profile: SandboxProfile, caps: SandboxCapabilities, key: bytes) -> Preparation:
    """A workdir, a cgroup and the layers with them, for a spare to apply ahead of its call."""
    held = _Held.make(profile, caps)
    return Preparation(
        key=key,
        message=held.spare_layers(profile).model_dump_json().encode(),
        held=held,
        release=held.release_later,
    )


def _make_cgroup(
    profile: SandboxProfile, caps: SandboxCapabilities
) -> cgroup.CallCgroup | None:
    """The call's cgroup, when the layer is available; a failure is logged once per reason."""
    if "cgroup" not in caps.available():
        return None
    try:
        return cgroup.CallCgroup.create(cgroup.hierarchies(), profile)
    except OSError as exc:
        with _warned_lock:
            first = str(exc) not in _warned
            _warned.add(str(exc))
        if first:
            _log.warning("could not create a cgroup for a call (%s); it runs without", exc)
        return None


def _clean_up(watch: _Watch | None, workdir: Workdir, mounted: bool) -> None:
    """Remove the workdir; wait for the child's end now only if it has to be gone first.

    A workdir the child mounted its tmpfs on holds nothing here: it is removed in the
    background (see `remove_workdir_later`)."""
    if mounted and watch is not None:
        remove_workdir_later(workdir)
    elif watch is None or watch.child.ended:
        remove_workdir(workdir)
    elif not remove_workdir(workdir):
        # A killed grandchild may still have been finishing a write: remove once the group is gone.
        watch.child.reap(block=True)
        remove_workdir(workdir)
    if watch is not None:
        watch.child.release()


def _planned_layers(
    profile: SandboxProfile, caps: SandboxCapabilities, with_cgroup: bool
) -> list[str]:
    """Layers the child was set up to apply; reported when it ends without saying (timeout, crash)."""
    available = caps.available()
    return [
        layer
        for layer in LAYERS
        if layer in available
        and (layer != "netns" or not profile.network)
        and (layer != "cgroup" or with_cgroup)
    ]


class _Child(Protocol):
    """A running sandbox child as the watch sees it: forked here, or by the zygote."""

    pid: int
    wait_status: int | None

    @property
    def exit_fd(self) -> int | None:
        """A descriptor readable once the child may have ended; None: poll `poll_exit`."""
        ...

    @property
    def ended(self) -> bool:
        """The child's end is known (its status, or why it is unavailable)."""
        ...

    @property
    def end_detail(self) -> str | None:
        """Why the status is unavailable, when it is."""
        ...

    def poll_exit(self) -> bool:
        """True once the child has ended (it may not be reaped yet)."""
        ...

    def reap(self, block: bool) -> bool:
        """Collect the child's status; True once it is known."""
        ...

    def kill_group(self, signum: int) -> None:
        """Signal the child's process group."""
        ...

    def release(self) -> None:
        """The call is over; the child is reaped later if it was not yet."""
        ...


class _ForkedChild:
    """A child forked by this process: exit seen on a pidfd, status from waitpid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.wait_status: int | None = None
        self.end_detail: str | None = None
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self.pidfd = None  # kernels before 5.3: poll waitpid instead

    @property
    def exit_fd(self) -> int | None:
        return self.pidfd

    @property
    def ended(self) -> bool:
        return self.wait_status is not None

    def poll_exit(self) -> bool:
        if self.pidfd is not None:
            # Readable pidfd: exited. The zombie is kept (reaped after the group kill).
            return bool(select.select([self.pidfd], [], [], 0)[0])
        return self.reap(block=False)

    def reap(self, block: bool) -> bool:
        if self.wait_status is not None:
            return True
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            # Reaped elsewhere (a SIGCHLD handler): the status is lost.
            self.wait_status = -1
            return True
        if pid == 0:
            return False
        self.wait_status = status
        return True

    def kill_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def release(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.wait_status is None:
            # Waiting for the kernel to tear down a forked worker image costs a millisecond or
            # more, so it happens off the call path.
            with _unreaped_lock:
                _unreaped.add(self.pid)


@dataclass(frozen=True)
class _Layers:
    """What the child is to apply, from the profile and this host's capabilities."""

    drop_uid: bool
    netns: bool
    landlock_abi: int
    write_paths: tuple[str, ...]
    seccomp_program: bytes | None
    cgroup_join: tuple[str, ...]
    disk_quota: bool
    hidden_paths: tuple[str, ...]
    ipc_namespace: bool

    @classmethod
    def plan(
        cls,
        profile: SandboxProfile,
        caps: SandboxCapabilities,
        call_cgroup: cgroup.CallCgroup | None,
        workdir: str,
    ) -> _Layers:
        available = caps.available()
        seccomp_program = None
        if "seccomp" in available:
            from toolchord.worker.sandbox.seccomp_filter import compile_filter

            # memfd pages count only against a cgroup: without one, no memfd_create.
            seccomp_program = compile_filter(
                network=profile.network,
                ipc_namespace="ipc" in available,
                memfd=call_cgroup is not None,
            )
        return cls(
            drop_uid="uid" in available,
            netns=not profile.network and "netns" in available,
            landlock_abi=caps.landlock_abi if "landlock" in available else 0,
            write_paths=(*DEVICE_PATHS, *profile.write_paths),
            seccomp_program=seccomp_program,
            cgroup_join=call_cgroup.join_files if call_cgroup is not None else (),
            disk_quota="disk" in available,
            hidden_paths=secret_directories(workdir) if "disk" in available else (),
            ipc_namespace="ipc" in available,
        )


def _start(
    spec: ToolSpec,
    args: BaseModel,
    context: ToolContext,
    limit: float,
    resources: _CallResources,
    direct_fork: DirectFork,
) -> _Watch:
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    res_r, res_w = os.pipe2(os.O_CLOEXEC)
    ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
    child_fds = (out_w, res_w, ctl_r)
    try:
        started_in = _start_in_zygote(spec, args, context, limit, resources, child_fds)
        child: _Child
        if isinstance(started_in, str):
            if direct_fork == "refuse":
                refused = DirectForkRefused(spec.name, started_in)
                if _first_time(f"refused:{spec.name}"):
                    _log.error("%s", refused)
                raise refused
            _note_direct(spec, started_in)
            held = resources.adopt(None)
            child = _fork_worker(
                spec, args, context, limit, held.workdir.path, held.layers, child_fds
            )
        else:
            held = resources.adopt(started_in.prepared)
            child = started_in
    except BaseException:
        for fd in (out_r, out_w, res_r, res_w, ctl_r, ctl_w):
            os.close(fd)
        raise
    # The deadline counts from the moment the call reached its child: waiting for a zygote
    # (loading a tool, or one that failed) is not the handler's time.
    started = time.monotonic()
    for fd in child_fds:
        os.close(fd)
    watch = _Watch(
        child, out_r, res_r, ctl_w, spec, context, limit, started, held.cgroup
    )
    try:
        watch.run()
    finally:
        for fd in (out_r, res_r, ctl_w):
            os.close(fd)
    return watch


def _start_in_zygote(
    spec: ToolSpec,
    args: BaseModel,
    context: ToolContext,
    limit: float,
    resources: _CallResources,
    child_fds: tuple[int, int, int],
) -> ZygoteCall | str:
    """Hand the call to a child of the zygote; or why the zygote cannot run it (switched off, or
    a tool it cannot import or load). Raises ZygoteUnavailable when the zygote is down: the call
    must then fail, never fall back to a fork of the worker.

    A spare confined ahead for this profile runs the call with its own workdir and cgroup; once
    the call is over, the spare it used is replaced and the spares on offer are confined for the
    same profile in the background (the next call most likely has the same profile)."""
    if not zygote_enabled():
        return f"the sandbox zygote is switched off ({ZYGOTE_ENV}=0)"
    locator = locate(spec)
    if locator is None:
        return (
            "the zygote cannot import it by name (defined in __main__ or inside a function, "
            "or not reachable as an attribute of its module)"
        )
    key = locator.model_dump_json()
    refused = _zygote_refused.get(key)
    if refused is not None:
        return refused
    profile = spec.sandbox
    arguments = CallArguments(
        args_json=args.model_dump_json(round_trip=True),
        context=context,
        timeout=limit,
        # The zygote's environment is only the allow-list: the worker's values travel with the call.
        environment={
            name: os.environ[name] for name in profile.env_allow if name in os.environ
        },
        timings=_timings,
    )

    def payload(prepared: Preparation | None) -> bytes:
        held = resources.for_spare(prepared)
        if prepared is not None and held is prepared.held:
            return arguments.model_dump_json().encode()  # the spare has its layers
        layers = held.spare_layers(profile)
        return CallPayload(**{**dict(layers), **dict(arguments)}).model_dump_json().encode()

    profile_key = _spare_key(profile, resources.caps)
    caps = resources.caps
    try:
        return zygote_client().submit(
            locator,
            payload,
            child_fds,
            profile_key,
            lambda: _preparation(profile, caps, profile_key),
        )
    except ZygoteToolError as exc:
        reason = _zygote_refused[key] = f"the zygote cannot load it: {exc}"
        return reason


def _fork_worker(
    spec: ToolSpec,
    args: BaseModel,
    context: ToolContext,
    limit: float,
    workdir: str,
    layers: _Layers,
    child_fds: tuple[int, int, int],
) -> _Child:
    """The direct path: fork this (worker) process."""
    profile = spec.sandbox
    plan = ChildPlan(
        spec=spec,
        args=args,
        context=context,
        timeout=limit,
        workdir=workdir,
        output_fd=child_fds[0],
        result_fd=child_fds[1],
        control_fd=child_fds[2],
        parent_pid=os.getpid(),
        drop_uid=layers.drop_uid,
        netns=layers.netns,
        landlock_abi=layers.landlock_abi,
        read_paths=(*code_read_paths(), *profile.read_paths),
        write_paths=layers.write_paths,
        seccomp_program=layers.seccomp_program,
        import_roots=private_import_roots() if layers.drop_uid else (),
        required=profile.required,
        cgroup_join=layers.cgroup_join,
        disk_quota=layers.disk_quota,
        hidden_paths=layers.hidden_paths,
        ipc_namespace=layers.ipc_namespace,
        worker_fork=True,
        secret_holders=secret_holders(),
        timings=_timings,
    )
    pid = os.fork()
    if pid == 0:
        child_main(plan)
    return _ForkedChild(pid)


# Tools (locators) the zygote failed to load, and why: it is not asked again.
_zygote_refused: dict[str, str] = {}
_direct_noted: set[str] = set()


class DirectForkRefused(Exception):
    """The zygote cannot run this tool and direct forks of the worker are refused."""

    def __init__(self, tool_name: str, reason: str) -> None:
        super().__init__(
            f"tool {tool_name} was not run: {reason}, and TOOLCHORD_SANDBOX_DIRECT_FORK=refuse "
            "forbids running it in a direct fork of the worker (whose memory holds the worker's "
            "secrets); define it at module level of a module the zygote can import "
            "(TOOLCHORD_TOOL_MODULES) without the worker's environment"
        )
        self.tool_name = tool_name


def _first_time(key: str) -> bool:
    with _warned_lock:
        if key in _direct_noted:
            return False
        _direct_noted.add(key)
        return True


def _note_direct(spec: ToolSpec, reason: str) -> None:
    # With the zygote switched off every call forks the worker, by the operator's choice.
    if not zygote_enabled() or not _first_time(spec.name):
        return
    _log.warning(
        "tool %s runs in a direct fork of the worker, not in the sandbox zygote: %s; its "
        "handler can read the worker's memory",
        spec.name,
        reason,
    )


class _Watch:
    """The worker side of one child: collect its pipes, enforce the deadline, reap it."""

    def __init__(
        self,
        child: _Child,
        out_fd: int,
        result_fd: int,
        control_fd: int,
        spec: ToolSpec,
        context: ToolContext,
        limit: float,
        started: float,
        call_cgroup: cgroup.CallCgroup | None = None,
    ) -> None:
        self.child = child
        self.cgroup = call_cgroup
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
        # Set by the worker only: the child wrote START_MARK, so the tool's code may have run.
        self.handler_started = False
        self.start_checked = False
        # The layers the child applied, from its layers mark (written before any tool code).
        self.applied_layers: list[str] | None = None
        self.layers_checked = False
        self.kill_reason: tuple[str, str] | None = None
        self.timed_out = False
        self.cancelled = False
        self.term_at: float | None = None
        self.cancel_seen_at: float | None = None
        self.killed_at: float | None = None
        os.set_blocking(out_fd, False)
        os.set_blocking(result_fd, False)

    def run(self) -> None:
        poller = select.poll()
        open_fds = {self.out_fd, self.result_fd}
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        exit_fd = self.child.exit_fd
        if exit_fd is not None:
            poller.register(exit_fd, select.POLLIN)
        next_cancel_poll = self.started + CANCEL_POLL_SECONDS
        while True:
            now = time.monotonic()
            if self.killed_at is not None and now >= self.killed_at + GRACE_SECONDS:
                # SIGKILL was sent a grace period ago and no end was reported (a zygote that
                # stopped answering): stop waiting, the status stays unknown.
                break
            if now >= next_cancel_poll:
                self._check_cancel(now)
                self._check_memory()
                next_cancel_poll = now + CANCEL_POLL_SECONDS
            wake = min(self._next_deadline(), next_cancel_poll)
            wait_ms = max(0, int((wake - now) * 1000) + 1)
            if exit_fd is None:
                wait_ms = min(wait_ms, 20)
            exited = self._poll(poller, open_fds, exit_fd, wait_ms)
            if not (exited or self.result_complete) and time.monotonic() >= self._next_deadline():
                # Look once more without waiting before enforcing the deadline: a poll cut short
                # by a signal after its timeout reports nothing. A result the child finished stays
                # its result even when this process reads it late (a paused worker, a loaded machine).
                exited = self._poll(poller, open_fds, exit_fd, 0)
            if exited or self.result_complete:
                break
            self._enforce_deadline(time.monotonic())
        # Kill what is left of the group (grandchildren, or the child that is about to exit
        # after its result) while the leader, alive or zombie, still holds the group id; then
        # take what was written before.
        self.child.kill_group(signal.SIGKILL)
        if self.cgroup is not None and "seccomp" not in (self.applied_layers or ()):
            # Also what left the group (a setsid'd grandchild where seccomp is off). Under
            # seccomp no process of the call can leave it (setsid and setpgid are refused): the
            # cgroup's kill then waits for its removal, after the outcome is returned.
            self.cgroup.kill_all()
        self._check_memory()
        for fd in open_fds:
            while self._read(fd):
                pass
        if exited and not self.child.ended:
            self.child.reap(block=True)

    def _poll(self, poller: select.poll, open_fds: set[int], exit_fd: int | None, wait_ms: int) -> bool:
        """Read what the child's pipes hold after up to `wait_ms`; True once the child has exited."""
        exited = False
        for fd, _events in poller.poll(wait_ms):
            if fd == exit_fd:
                exited = self.child.poll_exit()
                if exited:
                    poller.unregister(fd)
            elif not self._read(fd):
                poller.unregister(fd)
                open_fds.discard(fd)
        if exit_fd is None:
            exited = self.child.poll_exit()
        return exited

    def _next_deadline(self) -> float:
        if self.killed_at is not None:
            return self.killed_at + GRACE_SECONDS
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
                self._kill()
            elif now >= self.deadline and self.kill_reason is None:
                self.timed_out = True
                self.term_at = now
                self.child.kill_group(signal.SIGTERM)
        elif now >= self.term_at + GRACE_SECONDS and self.killed_at is None:
            self._kill()

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

    def _check_memory(self) -> None:
        """End the call once the kernel killed one of its processes at the cgroup's limit: the
        limit is the call's, like its timeout (cgroup v1 kills only the largest process)."""
        if self.cgroup is None or self.kill_reason is not None:
            return
        killed = self.cgroup.oom_kills()
        if killed:
            self._stop(
                "MemoryLimitExceeded",
                f"the call exceeded its memory limit of {self.spec.sandbox.memory_mb} MiB "
                f"(all of its processes together): the kernel killed {killed} of its processes "
                "and the rest of the call was stopped",
            )

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
        elif not self.result_complete and (
            self.kill_reason is None or not self.start_checked
        ):
            # The start mark counts even after a kill (an output flood): the handler ran.
            self.result += chunk
            self._check_start()
            if self.kill_reason is None:
                self._check_frame()
        return True

    def _check_start(self) -> None:
        if not self.layers_checked:
            if len(self.result) < LAYERS_MARK_BYTES:
                return
            self.layers_checked = True
            if self.result.startswith(LAYERS_MARK):
                self.applied_layers = decode_layers(bytes(self.result[:LAYERS_MARK_BYTES]))
                del self.result[:LAYERS_MARK_BYTES]
        if self.start_checked or len(self.result) < len(START_MARK):
            return
        self.start_checked = True
        if self.result.startswith(START_MARK):
            self.handler_started = True
            del self.result[: len(START_MARK)]

    def _check_frame(self) -> None:
        if len(self.result) < RESULT_HEADER_BYTES:
            return
        if not self.result.startswith(RESULT_MAGIC):
            return  # garbage: reported once the child has ended
        declared = self._declared_length()
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

    def _declared_length(self) -> int:
        return int.from_bytes(self.result[len(RESULT_MAGIC) : RESULT_HEADER_BYTES], "big")

    def _stop(self, error_type: str, message: str) -> None:
        self.kill_reason = (error_type, message)
        self._kill()

    def _kill(self) -> None:
        self.killed_at = time.monotonic()
        self.child.kill_group(signal.SIGKILL)

    def outcome(self, planned_layers: list[str]) -> HandlerOutcome:
        """How the call ended, with the captured output."""
        output = self.output.decode("utf-8", "replace")
        if self.output_total > len(self.output):
            output += f"\n[toolchord: {self.output_total - len(self.output)} more bytes of output dropped]"
        if self.result_complete and not (
            self.kill_reason or self.timed_out or self.cancelled
        ):
            # Only the first frame counts: a handler may have written one before the child's own.
            end = RESULT_HEADER_BYTES + self._declared_length()
            body = bytes(self.result[RESULT_HEADER_BYTES:end])
            try:
                reported = HandlerOutcome.model_validate_json(body)
            except ValueError as exc:
                outcome = self._protocol_error(type(exc).__name__, body)
            else:
                reported.output = output
                # Never the child's word: a hostile handler would claim "not started" to have an
                # unsafe call run again, a layer that was never applied, or a transient failure.
                reported.started = self.handler_started
                reported.sandbox_layers = self._layers(planned_layers)
                reported.transient = reported.status == "error" and (
                    reported.error_type in transient_type_names(self.spec)
                )
                return reported
        else:
            outcome = self._parent_verdict()
        # The child did not report, or its report does not count: describe what was set up.
        outcome.started = self.handler_started
        outcome.output = output
        outcome.duration_ms = (time.monotonic() - self.started) * 1000
        outcome.sandbox_layers = self._layers(planned_layers)
        return outcome

    def _layers(self, planned_layers: list[str]) -> list[str]:
        """The child's layers mark; what it was set up to apply if it ended before writing one."""
        return planned_layers if self.applied_layers is None else self.applied_layers

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
        status = self.child.wait_status
        if self.child.end_detail is not None:
            return f"child ended without a result ({self.child.end_detail})"
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
            return f"child exited with status {code}: sandbox setup failed before the result pipe was ready (the worker's log says why)"
        return f"child exited with status {code} without a result"
