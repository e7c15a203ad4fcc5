"""What a forked sandbox child does: confine itself, run the handler, send the outcome as JSON.

Runs only in a child forked by the zygote (`toolchord.worker.sandbox.zygote_server`) or, on the direct path,
by the worker (`toolchord.worker.sandbox.runner`); it must never return into the forking process's code
(every path ends in os._exit). File descriptors in the child have fixed numbers:
0 /dev/null, 1 and 2 the output pipe, 3 the result pipe, 4 the cancel pipe, 5.. import roots.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import io
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

from pydantic import BaseModel, ValidationError

from toolchord.worker.context import ToolContext
from toolchord.worker.execution import HandlerOutcome, call_handler
from toolchord.worker.sandbox import cgroup, disk, landlock
from toolchord.worker.sandbox.capabilities import LAYERS
from toolchord.worker.sandbox.import_paths import ImportRoot, redirect_imports
from toolchord.worker.sandbox.limits import apply_cpu_limit, apply_rlimits, mapped_bytes
from toolchord.worker.sandbox.profile import Layer, SandboxProfile
from toolchord.worker.sandbox.scrub import forget_worker_secrets
from toolchord.worker.sandbox.syscalls import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    drop_capabilities,
    load_seccomp_bpf,
    prctl,
    unshare,
    unshare_keeping_ids,
)
from toolchord.worker.tools import ToolSpec

RESULT_MAGIC = b"TCR1"
"""A result frame is RESULT_MAGIC, the JSON length as 8 bytes big-endian, then the JSON: the worker
knows the result is complete without waiting for the child's exit or end of file."""
RESULT_HEADER_BYTES = len(RESULT_MAGIC) + 8
LAYERS_MARK = b"TCL1"
"""Written on the result pipe once the child has confined itself, before the start mark (or its
refusal) and before any of the tool's code: LAYERS_MARK and a 2-byte mask of the layers applied
(bit i: LAYERS[i]). The worker reports these, never the layers a frame claims."""
LAYERS_MARK_BYTES = len(LAYERS_MARK) + 2
START_MARK = b"TCS1"
"""Written on the result pipe, before any of the tool's code (argument validators included) runs.
The worker decides `HandlerOutcome.started` from it: a handler cannot take it back by writing a
frame that claims it never started, while a child that refused the call before this point
(a required layer missing) reports started=False truthfully."""
RESULT_FD = 3
CONTROL_FD = 4
FIRST_ROOT_FD = 5
# Exit status of a child that failed before its result pipe was in place.
SETUP_FAILED_STATUS = 71
TIMINGS_PREFIX = b"\n[toolchord-timings] "
"""Benchmarks only (`ChildPlan.timings`): written to stderr, just before the result frame, with a
JSON list of [step, CLOCK_MONOTONIC seconds, this process's CPU seconds] for each step."""
# Per-call uids start here: far above distribution, systemd-dynamic and usual subuid ranges, and
# pid_max (2**22) more still fits below 2**31.
PER_CALL_UID_BASE = 2_000_000_000

_RESET_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGCHLD,
    signal.SIGXCPU,
)
# Old stream objects are kept alive so that their finalizers never flush worker output into the
# capture pipe.
_retired_streams: list[object] = []
_initial_block_wiped = False
_marks: list[tuple[str, float, float]] | None = None


@dataclass(frozen=True)
class ChildPlan:
    """Everything the child needs, prepared before fork.

    `args` is the validated model on the direct path; from the zygote it is the JSON the worker
    validated, checked again against the tool's model only once the child is confined (model
    validators are user code). `environment` holds the worker's values of the profile's
    `env_allow` variables when the forking process (the zygote) does not have them; None takes
    them from this process's environment. `cgroup_join` are the files through which the child
    joins its call's cgroup before anything else (empty: no cgroup layer); `disk_quota` mounts the
    workdir as a tmpfs of the profile's `disk_mb` in a mount namespace of the call's own, where
    `hidden_paths` (the worker's secret directories and files) are covered by empty ones;
    `ipc_namespace` gives the call SysV IPC and POSIX message queues of its own. `process_group`
    "own" makes the child only a process group leader: enough for the group kill when the forking
    process has no controlling terminal (the zygote), and much cheaper where the kernel creates a
    scheduler autogroup per session; "inherited" keeps the group of the call's pid namespace init,
    which the worker kills. `worker_fork` marks a direct fork of the worker, which forgets the
    worker's connection secrets (`toolchord.worker.sandbox.scrub`) before anything else runs.
    `timings` (benchmarks) reports when each step ended (TIMINGS_PREFIX).
    """

    spec: ToolSpec
    args: BaseModel | str
    context: ToolContext
    timeout: float
    workdir: str
    output_fd: int
    result_fd: int
    control_fd: int
    parent_pid: int
    drop_uid: bool
    netns: bool
    landlock_abi: int
    read_paths: tuple[str, ...]
    write_paths: tuple[str, ...]
    seccomp_program: bytes | None
    import_roots: tuple[ImportRoot, ...] = ()
    required: frozenset[Layer] = field(default_factory=frozenset)
    environment: Mapping[str, str] | None = None
    process_group: Literal["session", "own", "inherited"] = "session"
    cgroup_join: tuple[str, ...] = ()
    disk_quota: bool = False
    hidden_paths: tuple[str, ...] = ()
    ipc_namespace: bool = False
    worker_fork: bool = False
    # A direct fork's copies of the worker's secret-holding objects, found before the fork.
    secret_holders: tuple[Any, ...] = ()
    timings: bool = False

    @property
    def profile(self) -> SandboxProfile:
        return self.spec.sandbox


def start_timings(step: str, at: tuple[float, float] | None = None) -> None:
    """Record the end of each setup step from now on (after those already recorded, by a spare
    confined ahead), starting with `step`, which ended `at` (monotonic, CPU seconds; default
    now). Benchmarks only."""
    global _marks
    if _marks is None:
        _marks = []
    if at is None:
        mark(step)
    else:
        _marks.append((step, *at))


def step_end() -> tuple[float, float]:
    """(monotonic, CPU seconds of this process): when a setup step ended, for the timings."""
    return time.monotonic(), time.process_time()


def mark(step: str) -> None:
    """Note that `step` just ended, when timings are on; nothing otherwise."""
    if _marks is not None:
        _marks.append((step, *step_end()))


def exit_setup_failed() -> NoReturn:
    """Exit with SETUP_FAILED_STATUS, from an `except` block, after one line on stderr saying
    why: before its pipes are in place that is the worker's (or zygote's) stderr, its log, the
    only place a child that fails this early can tell."""
    try:
        error = sys.exc_info()[1]
        os.write(
            2,
            f"toolchord sandbox: a call's child failed before its result pipe was ready: "
            f"{type(error).__name__}: {error}\n".encode(errors="replace"),
        )
    finally:
        os._exit(SETUP_FAILED_STATUS)


def child_main(plan: ChildPlan, confinement: Confinement | None = None) -> NoReturn:
    """Entry point right after fork, or in a spare confined ahead of its call (`confinement`,
    from `confine_ahead` with the same layers); never returns."""
    own_pid = os.getpid()
    if plan.timings and _marks is None:
        start_timings("fork")
    try:
        if plan.process_group == "session":
            os.setsid()
        elif plan.process_group == "own":
            os.setpgid(0, 0)
        _arrange_fds(plan)
        if plan.worker_fork:
            forget_worker_secrets(plan.secret_holders)
        mark("descriptors")
    except BaseException:  # noqa: BLE001 - nothing may unwind into the worker's stack
        exit_setup_failed()
    # Inherited objects go to the permanent generation: a collection in the child then never walks
    # (and so never copies) the worker's whole heap. The child is short-lived, nothing leaks.
    gc.freeze()
    try:
        outcome = _confine_and_run(plan, confinement)
    except BaseException as exc:  # noqa: BLE001
        outcome = HandlerOutcome(
            status="crashed",
            started=False,
            error_type="SandboxSetupError",
            error_message=f"sandbox setup failed: {type(exc).__name__}: {exc}",
        )
    try:
        if (
            os.getpid() == own_pid
        ):  # a forked grandchild returning here must stay silent
            _send(outcome)
    finally:
        os._exit(0)


def rehearse(plan: ChildPlan) -> None:
    """Run the parts of a call that leave nothing the real call depends on, with a sample plan.

    Done by a spare child of the zygote while it waits for its call: the first pass over this
    code writes reference counts and caches on pages shared copy-on-write with the zygote, and
    copying those pages is most of a child's setup cost. The real call then runs it all again
    (stream and environment reset included), only faster. The plan's descriptors are not used.
    """
    _reset_process_state()
    _scrub_environment(plan)
    mapped_bytes()
    context = plan.context.model_copy(update={"workdir": plan.workdir})
    context.bind_cancel_check(_CancelFlag())
    args = (
        plan.spec.args_model.model_validate_json(plan.args)
        if isinstance(plan.args, str)
        else plan.args
    )
    outcome = call_handler(plan.spec, args, context)
    outcome.sandbox_layers = ["rlimits"]
    outcome.model_dump_json()


def _arrange_fds(plan: ChildPlan) -> None:
    """Move the pipes to fixed numbers and close everything else inherited from the worker."""
    sources = [
        plan.output_fd,
        plan.result_fd,
        plan.control_fd,
        *(root.fd for root in plan.import_roots),
    ]
    last_target = FIRST_ROOT_FD + len(plan.import_roots)
    floor = max(max(sources), last_target) + 1
    # Copy above every source and target first so that no dup2 below clobbers a source.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in sources]
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(moved[0], 1)
    os.dup2(moved[0], 2)
    os.dup2(moved[1], RESULT_FD, inheritable=False)
    os.dup2(moved[2], CONTROL_FD, inheritable=False)
    for index, fd in enumerate(moved[3:]):
        os.dup2(fd, FIRST_ROOT_FD + index, inheritable=False)
    # The original descriptors (including devnull's first number) are either overwritten by the
    # dup2 calls above or at/above last_target.
    os.closerange(last_target, 1 << 20)
    os.set_blocking(CONTROL_FD, False)


def _reset_process_state() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for signum in _RESET_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    _retired_streams.extend((sys.stdin, sys.stdout, sys.stderr))
    # Fresh streams on the fixed descriptors: the worker's may be logging proxies (Celery) or
    # capture objects (pytest). write_through keeps partial output visible on a timeout.
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        write_through=True,
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        write_through=True,
    )
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")


def _scrub_environment(plan: ChildPlan) -> None:
    """Keep only allowed variables, then wipe the original environment and arguments in memory."""
    profile = plan.profile
    source = os.environ if plan.environment is None else plan.environment
    kept = {name: source[name] for name in profile.env_allow if name in source}
    os.environ.clear()
    os.environ.update(kept)
    os.environ.update(profile.env)
    os.environ["HOME"] = plan.workdir
    os.environ["TMPDIR"] = plan.workdir
    _wipe_initial_block()
    sys.argv[:] = sys.argv[:1]
    sys.orig_argv[:] = sys.orig_argv[:1]


def _wipe_initial_block() -> None:
    """Zero the environment strings (and arguments after argv[0]) the kernel put on the stack.

    os.environ.clear() only unlinks them; the bytes would otherwise stay readable in the child's
    memory and in /proc/self/environ. Once per process (a spare child does it while it waits).
    """
    global _initial_block_wiped
    if _initial_block_wiped:
        return
    with open("/proc/self/stat", "rb") as stat_file:
        fields = stat_file.read().rsplit(b")", 1)[1].split()
    # Fields 48-51 of proc(5): arg_start, arg_end, env_start, env_end (field 3 is fields[0]).
    arg_start, arg_end, env_start, env_end = (int(value) for value in fields[45:49])
    if env_end > env_start:
        ctypes.memset(env_start, 0, env_end - env_start)
    if arg_end > arg_start:
        first = len(ctypes.string_at(arg_start)) + 1
        if arg_end > arg_start + first:
            ctypes.memset(arg_start + first, 0, arg_end - arg_start - first)
    _initial_block_wiped = True


def _drop_privileges(plan: ChildPlan) -> None:
    uid = plan.profile.uid or PER_CALL_UID_BASE + os.getpid()
    os.chown(plan.workdir, uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _apply_namespaces(plan: ChildPlan, applied: list[Layer], failures: dict[Layer, str]) -> None:
    """The `disk`, `netns` and `ipc` layers: a mount namespace with the workdir quota and the
    secrets hidden, a network namespace without network, an IPC namespace whose objects end with
    the call.

    A root worker's child creates them with its own privilege. An unprivileged worker's child
    first becomes the owner of a user namespace that maps only its own ids, which lets it create
    them and grants nothing outside them, and then gives up the capabilities it holds there: with
    them the call could unmount the tmpfs that covers the secrets.
    """
    layers: tuple[tuple[Layer, bool], ...] = (
        ("disk", plan.disk_quota),
        ("netns", plan.netns),
        ("ipc", plan.ipc_namespace),
    )
    wanted = [layer for layer, on in layers if on]
    if not wanted:
        return
    unprivileged = os.geteuid() != 0
    if unprivileged:
        try:
            unshare_keeping_ids(0)
        except OSError as exc:
            failures.update((layer, f"user namespace: {exc}") for layer in wanted)
            return
        mark("user namespace")
    if plan.disk_quota:
        try:
            disk.mount_workdir(plan.workdir, plan.profile.disk_mb, plan.hidden_paths)
            applied.append("disk")
        except OSError as exc:
            failures["disk"] = str(exc)
        mark("mount namespace and tmpfs")
    namespaces: tuple[tuple[Layer, bool, int], ...] = (
        ("netns", plan.netns, CLONE_NEWNET),
        ("ipc", plan.ipc_namespace, CLONE_NEWIPC),
    )
    for layer, on, flag in namespaces:
        if on:
            try:
                unshare(flag)
                applied.append(layer)
            except OSError as exc:
                failures[layer] = str(exc)
            mark(f"{layer} namespace")
    if unprivileged:
        drop_capabilities()  # raises rather than let the call run with them


@dataclass
class Confinement:
    """The layers a child applied so far, and why the others failed."""

    applied: list[Layer] = field(default_factory=list)
    failures: dict[Layer, str] = field(default_factory=dict)
    ahead: bool = False
    """Applied ahead of the call, with every rlimit but RLIMIT_CPU."""


def confine_ahead(plan: ChildPlan) -> Confinement:
    """In a spare waiting for its call: apply every layer that does not depend on the call's
    arguments (cgroup, namespaces and workdir tmpfs, uid, Landlock, seccomp), as `child_main`
    would. Descriptors, environment, imports and rlimits follow when the call arrives
    (`child_main(plan, confinement)`), before any of the tool's code runs."""
    return _confine(plan, ahead=True)


def _confine(plan: ChildPlan, ahead: bool = False) -> Confinement:
    """The layers, in order; with `ahead`, without the call's own part (`_call_part`). Import
    roots are then still at the descriptors inherited from the zygote."""
    profile = plan.profile
    confinement = Confinement(ahead=ahead)
    applied, failures = confinement.applied, confinement.failures
    if plan.cgroup_join:
        # First: everything the call does from here on counts against its cgroup's limits.
        try:
            cgroup.join(plan.cgroup_join)
            applied.append("cgroup")
        except OSError as exc:
            failures["cgroup"] = str(exc)
        mark("cgroup join")
    _reset_process_state()
    mark("signals and streams")
    _apply_namespaces(plan, applied, failures)
    os.chdir(plan.workdir)
    if ahead:
        # Both read /proc, which Landlock hides from here on.
        _wipe_initial_block()
        _apply_rlimits(plan, confinement, timeout=None)
    else:
        _call_part(plan, confinement)
    if plan.drop_uid:
        try:
            _drop_privileges(plan)
            applied.append("uid")
        except OSError as exc:
            failures["uid"] = str(exc)
        mark("uid")
    # The kernel clears the parent-death signal on a uid change, so it is set afterwards; the
    # ppid check closes the race with a worker that died before this line.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != plan.parent_pid:
        os._exit(0)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    mark("parent-death signal")
    if plan.landlock_abi:
        try:
            parts = landlock.restrict_self(
                plan.landlock_abi,
                landlock.LandlockPlan(
                    confine_fs=profile.filesystem == "confined",
                    read_paths=plan.read_paths,
                    write_paths=(plan.workdir, *plan.write_paths),
                    read_fds=tuple(
                        root.fd if ahead else FIRST_ROOT_FD + i
                        for i, root in enumerate(plan.import_roots)
                    ),
                    deny_tcp=not profile.network,
                    scope_signals=True,
                    scope_abstract_unix=not profile.network,
                ),
            )
            if parts:
                applied.append("landlock")
        except OSError as exc:
            failures["landlock"] = str(exc)
        mark("landlock")
    if plan.seccomp_program is not None:
        try:
            load_seccomp_bpf(plan.seccomp_program)
            applied.append("seccomp")
        except OSError as exc:
            failures["seccomp"] = str(exc)
        mark("seccomp")
    return confinement


def _call_part(plan: ChildPlan, confinement: Confinement) -> None:
    """The layers that come with the call: its environment, import redirection and rlimits."""
    _scrub_environment(plan)
    if plan.drop_uid:
        redirect_imports(
            {root.path: FIRST_ROOT_FD + i for i, root in enumerate(plan.import_roots)}
        )
    mark("environment and imports")
    if confinement.ahead:
        apply_cpu_limit(plan.profile, plan.timeout)
    else:
        _apply_rlimits(plan, confinement, plan.timeout)
    confinement.applied.append("rlimits")
    mark("rlimits")


def _apply_rlimits(plan: ChildPlan, confinement: Confinement, timeout: float | None) -> None:
    profile = plan.profile
    apply_rlimits(
        profile,
        timeout,
        # Without a cgroup, RLIMIT_NPROC is what bounds the call's total memory, and it counts
        # only this call's processes when the call has a uid of its own.
        strict_processes="cgroup" not in confinement.applied
        and plan.drop_uid
        and profile.uid is None,
    )


def _confine_and_run(plan: ChildPlan, confinement: Confinement | None) -> HandlerOutcome:
    if confinement is None:
        confinement = _confine(plan)
    else:
        _call_part(plan, confinement)
    applied, failures = confinement.applied, confinement.failures
    _write_all(encode_layers(applied))
    missing = sorted(layer for layer in plan.required if layer not in applied)
    if missing:
        detail = "; ".join(
            f"{layer}: {failures.get(layer, 'not applied')}" for layer in missing
        )
        return HandlerOutcome(
            status="error",
            started=False,
            error_type="SandboxUnavailable",
            error_message=f"required sandbox layer(s) could not be applied: {detail}",
            sandbox_layers=list(applied),
        )
    _write_all(START_MARK)
    context = plan.context.model_copy(update={"workdir": plan.workdir})
    context.bind_cancel_check(_CancelFlag())
    if isinstance(plan.args, str):
        try:
            args = plan.spec.args_model.model_validate_json(plan.args)
        except ValidationError as exc:
            return HandlerOutcome(
                status="error",
                started=False,
                error_type="ValidationError",
                error_message=str(exc),
                sandbox_layers=list(applied),
            )
    else:
        args = plan.args
    mark("arguments")
    try:
        outcome = call_handler(plan.spec, args, context)
    except SystemExit as exc:
        outcome = HandlerOutcome(
            status="error",
            error_type="SystemExit",
            error_message=f"handler called sys.exit({exc.code!r})",
        )
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt and friends become values too
        outcome = HandlerOutcome(
            status="error", error_type=type(exc).__name__, error_message=str(exc)
        )
    outcome.sandbox_layers = list(applied)
    mark("handler")
    return outcome


def encode_layers(applied: list[Layer]) -> bytes:
    """The layers mark for `applied`."""
    mask = sum(1 << LAYERS.index(layer) for layer in set(applied))
    return LAYERS_MARK + mask.to_bytes(2, "big")


def decode_layers(mark: bytes) -> list[str]:
    """The layers a layers mark (LAYERS_MARK_BYTES long) names, in LAYERS order."""
    mask = int.from_bytes(mark[len(LAYERS_MARK) : LAYERS_MARK_BYTES], "big")
    return [layer for index, layer in enumerate(LAYERS) if mask & (1 << index)]


class _CancelFlag:
    """Cancel check inside the child: the worker writes a byte to the control pipe to cancel."""

    def __init__(self) -> None:
        self._cancelled = False

    def __call__(self) -> bool:
        if not self._cancelled:
            try:
                self._cancelled = os.read(CONTROL_FD, 1) != b""
            except BlockingIOError:
                pass
            except OSError:
                return False
        return self._cancelled


def _send(outcome: HandlerOutcome) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    body = outcome.model_dump_json().encode()
    if _marks is not None:
        mark("result encoded")
        report = json.dumps(_marks).encode()
        try:
            os.write(2, TIMINGS_PREFIX + report + b"\n")
        except OSError:
            pass
    _write_all(RESULT_MAGIC + len(body).to_bytes(8, "big") + body)


def _write_all(data: bytes) -> None:
    payload = memoryview(data)
    while payload:
        written = os.write(RESULT_FD, payload)
        payload = payload[written:]
