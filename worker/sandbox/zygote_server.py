"""The zygote: a clean interpreter that forks one sandbox child per tool call.

The worker starts it as `python -I` with only an allow-listed environment and no inherited
descriptors but its control socket (`toolchord.worker.sandbox.zygote`). It imports the trusted tool modules
and toolchord's child code, nothing else of the worker: the broker URL, API keys and everything
else the worker holds in memory or in its environment never exist in this process, so a forked
child cannot read them from its copy of the heap.

It forks *spare* children ahead of their calls and offers them to the worker, which sends each call
straight to a spare: forking and the child's first touches of the memory it shares copy-on-write
with the zygote cost milliseconds, paid while no call waits. One thread, one selector loop:
requests and child exits (pidfds) are handled as they come; the worker keeps several spares, so
concurrent calls from several worker threads run side by side. The zygote dies with the worker
(parent-death signal, and end of file on the control socket), and its children die with it
(parent-death signal from their start, set again after their uid change, which clears it).

An unprivileged worker's calls keep its uid, so without Landlock's signal scoping (ABI 6) they
could signal the zygote and the worker. Such a zygote serves from a pid namespace of its own (in
a user namespace of its own, which mapping only the worker's uid grants nothing): it is that
namespace's init, which its children cannot kill, and the worker and everything else outside are
invisible to them. The process the worker started stays outside as a keeper that waits for it.
There, each spare child is moreover the init of a pid namespace of its own (nested in the
zygote's), and the call runs in its child: calls cannot see or signal each other or other spares.
"""

from __future__ import annotations

import array
import fcntl
import gc
import importlib
import os
import select
import selectors
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NoReturn, TypedDict

from toolchord.worker.context import ToolContext
from toolchord.worker.registry import Registry
from toolchord.worker.sandbox.child import (
    ChildPlan,
    child_main,
    confine_ahead,
    exit_setup_failed,
    mark,
    rehearse,
    start_timings,
    step_end,
)
from toolchord.worker.sandbox.import_paths import ImportRoot, private_import_roots
from toolchord.worker.sandbox.profile import SandboxProfile
from toolchord.worker.sandbox.read_paths import code_read_paths
from toolchord.worker.sandbox.syscalls import (
    CAP_SYS_ADMIN,
    CLONE_NEWPID,
    PR_SET_PDEATHSIG,
    drop_capabilities,
    prctl,
    setns,
    unshare,
    unshare_keeping_ids,
)
from toolchord.worker.sandbox.zygote_protocol import (
    CALL_FD_COUNT,
    MAX_MESSAGE_BYTES,
    CallArguments,
    CallPayload,
    LoadReply,
    SpareLayers,
    SpareOffer,
    ToolLocator,
    ZygoteInit,
    ZygoteReady,
    ZygoteReply,
    ZygoteRequest,
)
from toolchord.worker.tools import ToolSpec, tool

BOOTSTRAP = """\
import json, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
init = sock.recv(1 << 20)
sys.path[:] = json.loads(init)["sys_path"]
from toolchord.worker.sandbox.zygote_server import serve
serve(sock, init)
"""
"""What `python -I -c` runs: the import path comes from the worker before anything is imported."""


@dataclass
class _Child:
    """A forked child (spare or running a call) and the socket its end is reported on."""

    pid: int
    pidfd: int
    status: socket.socket
    call_status: int = -1
    """Read end on which a call namespace's init reports how the call's process ended."""


def serve(sock: socket.socket, raw_init: bytes) -> NoReturn:
    """Run the zygote on its control socket until the worker goes away; never returns."""
    init = ZygoteInit.model_validate_json(raw_init)
    # The worker started this process from a thread that lives as long as the worker process.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != init.parent_pid:
        os._exit(0)
    namespace_error = _enter_pid_namespace(sock) if init.pid_namespace else None
    in_namespace = init.pid_namespace and namespace_error is None
    call_namespaces_error = None
    unprivileged_namespace = in_namespace and os.geteuid() != 0
    if unprivileged_namespace:
        call_namespaces_error = _in_throwaway_child(lambda: unshare(CLONE_NEWPID))
        if call_namespaces_error is not None:
            # Kept only to create those namespaces: the spares must not inherit it.
            drop_capabilities()
    failed: dict[str, str] = {}
    for name in init.modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - a broken tool module must not stop the zygote
            failed[name] = f"{type(exc).__name__}: {exc}"
    # Objects that exist now are never collected: children then do not touch (and copy) them.
    gc.freeze()
    zygote = _Zygote(
        sock,
        in_namespace,
        call_namespaces=unprivileged_namespace and call_namespaces_error is None,
    )
    ready = ZygoteReady(
        pid=_outer_pid() if in_namespace else os.getpid(),
        pid_namespace=namespace_error,
        call_pid_namespaces=call_namespaces_error,
        failed_modules=failed,
    )
    sock.send(ready.model_dump_json().encode())
    zygote.fork_spares(init.spares)
    zygote.loop()


def _enter_pid_namespace(sock: socket.socket) -> str | None:
    """Continue in a pid namespace of its own, as its init; None, or why it was not possible.

    The calling process stays outside as the keeper: it waits for the new one and ends the same
    way, so the worker's view of its zygote process does not change. The new process is killed
    with the keeper (parent-death signal), and the namespace's other processes with it.
    """
    user_namespace = os.geteuid() != 0
    # Tried first in a throwaway child: a namespace that cannot be completed (the id maps refused)
    # cannot be left again, while a zygote without one can still serve.
    failure = _in_throwaway_child(lambda: _unshare_pid_namespace(user_namespace))
    if failure is not None:
        return failure
    _unshare_pid_namespace(user_namespace)
    keeper_alive, keeper_end = os.pipe()
    pid = os.fork()
    if pid:
        sock.close()
        os.close(keeper_alive)
        _keep(pid)
    os.close(keeper_end)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([keeper_alive], [], [], 0)[0]:
        os._exit(0)  # the keeper is gone already: end of file on its pipe
    os.close(keeper_alive)
    if user_namespace:
        # The creator of a user namespace holds every capability in it; the zygote keeps only
        # the one that creates its calls' pid namespaces (its children drop it at once).
        drop_capabilities(keep=(CAP_SYS_ADMIN,))
    # As init, the zygote receives from inside its namespace only signals it handles: keep none.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return None


def _unshare_pid_namespace(user_namespace: bool) -> None:
    """New pid namespace for the next child, inside a new user namespace when not root."""
    if user_namespace:
        # Only the worker's own ids: the namespace grants nothing the worker did not have.
        unshare_keeping_ids(CLONE_NEWPID)
    else:
        unshare(CLONE_NEWPID)


def _in_throwaway_child(action: Callable[[], None]) -> str | None:
    """Run `action` in a forked child; None if it worked, else what it raised."""
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(report_w, f"{type(exc).__name__}: {exc}".encode()[:4096])
        os._exit(0)
    os.close(report_w)
    report = os.read(report_r, 4096)
    os.close(report_r)
    os.waitpid(pid, 0)
    return report.decode("utf-8", "replace") or None


def _keep(pid: int) -> NoReturn:
    """In the keeper: wait for the zygote in the namespace and end as it ended."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:
            # Setting SIGKILL's disposition raises (and the keeper then exited with status 1).
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _outer_pid() -> int:
    """This process's pid as the worker numbers it (/proc belongs to the worker's namespace)."""
    return int(os.readlink("/proc/self"))


class _Zygote:
    def __init__(
        self,
        sock: socket.socket,
        in_namespace: bool = False,
        call_namespaces: bool = False,
    ) -> None:
        self.sock = sock
        self.in_namespace = in_namespace
        # Each spare forked into a pid namespace of its own; the zygote returns to its own
        # namespace (for its next children) through this descriptor.
        self.own_pid_namespace = (
            os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            if call_namespaces
            else -1
        )
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ, None)
        self.orphans_r = -1
        if in_namespace:
            # Orphans of the namespace become the zygote's children: SIGCHLD (through a wakeup
            # pipe, so the loop sees it) gets them reaped as they end. Children reset both.
            self.orphans_r, orphans_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
            signal.set_wakeup_fd(orphans_w, warn_on_full_buffer=False)
            self.selector.register(self.orphans_r, selectors.EVENT_READ, self.orphans_r)
        self.children: dict[int, _Child] = {}
        self.specs: dict[bytes, ToolSpec] = {}

    def loop(self) -> NoReturn:
        while True:
            for key, _events in self.selector.select():
                if key.data is None:
                    self._receive()
                elif key.data == self.orphans_r:
                    self._drain(self.orphans_r)
                    self._reap_orphans()
                else:
                    self._finish(key.data)

    def _receive(self) -> None:
        fds = array.array("i")
        try:
            message, ancillary, _flags, _address = self.sock.recvmsg(
                MAX_MESSAGE_BYTES, socket.CMSG_SPACE(fds.itemsize)
            )
        except ConnectionError:
            # A worker that closes its end with spare offers still unread resets the connection:
            # as normal a stop as end of file.
            self._shut_down()
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if not message and not fds:
            self._shut_down()
        reply = socket.socket(fileno=fds[0]) if fds else None
        try:
            request = ZygoteRequest.model_validate_json(message)
            if request.load is not None and reply is not None:
                self._load(request.load, reply)
            self.fork_spares(request.spares)
        finally:
            if reply is not None:
                reply.close()

    def _load(self, locator: ToolLocator, reply: socket.socket) -> None:
        try:
            self.resolve(locator.model_dump_json().encode())
        except BaseException as exc:  # noqa: BLE001 - reported; the worker uses its own fork
            answer = LoadReply(error=f"{type(exc).__name__}: {exc}")
        else:
            answer = LoadReply(generation=len(sys.modules))
        _send(reply, answer.model_dump_json().encode())

    def resolve(self, key: bytes) -> ToolSpec:
        """The tool a locator (as JSON) names, importing its module on first use."""
        spec = self.specs.get(key)
        if spec is None:
            locator = ToolLocator.model_validate_json(key)
            value: object = importlib.import_module(locator.module)
            for part in locator.attribute.split("."):
                value = getattr(value, part)
            if locator.function_tool is not None:
                if isinstance(value, ToolSpec):
                    value = value.handler
                if not callable(value):
                    raise TypeError(f"{locator.module}.{locator.attribute} is not a function")
                value = tool(value, name=locator.function_tool)
            elif locator.registry_tool is not None:
                if not isinstance(value, Registry):
                    raise TypeError(
                        f"{locator.module}.{locator.attribute} is not a Registry"
                    )
                value = value[locator.registry_tool]
            if not isinstance(value, ToolSpec):
                raise TypeError(
                    f"{locator.module}.{locator.attribute} is not a ToolSpec"
                )
            spec = self.specs[key] = value
        return spec

    def fork_spares(self, count: int) -> None:
        """Fork children for the next calls and offer them to the worker."""
        for _ in range(count):
            try:
                self._fork_spare()
            except OSError:
                return  # out of processes or descriptors: the worker falls back when it waits in vain

    def _fork_spare(self) -> None:
        call_ours, call_theirs = socket.socketpair(
            socket.AF_UNIX, socket.SOCK_SEQPACKET
        )
        status_ours, status_theirs = socket.socketpair(
            socket.AF_UNIX, socket.SOCK_SEQPACKET
        )
        read_paths = code_read_paths()
        roots = private_import_roots()
        zygote_pid = os.getpid()
        generation = len(sys.modules)
        numbered_r, numbered_w = os.pipe2(os.O_CLOEXEC)
        call_status_r, call_status_w = (
            os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            if self.own_pid_namespace >= 0
            else (-1, -1)
        )
        try:
            pid = self._fork()
            if pid == 0:
                # The worker's ends must not stay open here: the spare waits for end of file on
                # its call socket when the worker lets it go.
                for sock in (call_ours, status_ours, status_theirs):
                    sock.close()
                os.close(numbered_r)
                if self.in_namespace:
                    os.write(numbered_w, str(_outer_pid()).encode())
                os.close(numbered_w)
                nested = call_status_w >= 0
                if nested:
                    os.close(call_status_r)
                    os.close(self.own_pid_namespace)

                def spare() -> NoReturn:
                    # Both the zygote and a call namespace's init are pid 1 of their namespace.
                    _spare_main(
                        call_theirs,
                        self.resolve,
                        read_paths,
                        roots,
                        zygote_pid,
                        nested,
                    )

                if nested:
                    _call_namespace_init(call_theirs, call_status_w, spare)
                spare()
            call_theirs.close()
            if call_status_w >= 0:
                os.close(call_status_w)
                call_status_w = -1
            os.close(numbered_w)
            numbered_w = -1
            outer = os.read(numbered_r, 32) if self.in_namespace else b""
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                # A child that cannot be watched must not run.
                _kill_group(pid)
                os.waitpid(pid, 0)
                raise
            child = _Child(pid, pidfd, status_ours, call_status_r)
            call_status_r = -1
            self.children[pid] = child
            self.selector.register(pidfd, selectors.EVENT_READ, child)
            if self.in_namespace and not outer:
                raise OSError(f"spare child {pid} ended before it could be offered")
            offer = (
                SpareOffer(pid=int(outer or pid), generation=generation)
                .model_dump_json()
                .encode()
            )
            fds = array.array("i", [call_ours.fileno(), status_theirs.fileno()])
            self.sock.sendmsg([offer], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError:
            status_ours.close()
            raise
        finally:
            call_ours.close()
            status_theirs.close()
            call_theirs.close()
            os.close(numbered_r)
            for fd in (numbered_w, call_status_r, call_status_w):
                if fd >= 0:
                    os.close(fd)

    def _fork(self) -> int:
        """fork(), into a new pid namespace (as its init) when calls get namespaces of their own."""
        if self.own_pid_namespace < 0:
            return os.fork()
        unshare(CLONE_NEWPID)
        try:
            pid = os.fork()
        except BaseException:
            setns(self.own_pid_namespace, CLONE_NEWPID)
            raise
        if pid:
            # The new namespace's init keeps it for the child it forks; the zygote goes back.
            setns(self.own_pid_namespace, CLONE_NEWPID)
        return pid

    def _finish(self, child: _Child) -> None:
        """A child exited: kill what is left of its group while the zombie still holds the group
        id, reap it and report its status."""
        self.selector.unregister(child.pidfd)
        os.close(child.pidfd)
        del self.children[child.pid]
        _kill_group(child.pid)
        _, wait_status = os.waitpid(child.pid, 0)
        if child.call_status >= 0:
            wait_status = _call_status(child.call_status, wait_status)
        if self.in_namespace:
            self._reap_orphans()
        _send(child.status, ZygoteReply(status=wait_status).model_dump_json().encode())
        child.status.close()

    @staticmethod
    def _drain(fd: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except BlockingIOError:
            pass

    def _reap_orphans(self) -> None:
        """As init, the zygote inherits the orphans of its namespace (a call's grandchildren,
        killed with its group): reap those, never a spare or call it watches on a pidfd."""
        while True:
            try:
                found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if found is None or found.si_pid in self.children:
                return
            os.waitpid(found.si_pid, 0)

    def _shut_down(self) -> NoReturn:
        """The worker closed the control socket (or died): nothing may outlive it."""
        for pid in self.children:
            _kill_group(pid)
        os._exit(0)


def _call_status(call_status: int, init_status: int) -> int:
    """How a call's process ended, as its namespace's init reported it before exiting; the
    init's own wait status if it did not (killed with the call's group: so was the call)."""
    try:
        reported = os.read(call_status, 4)
    except BlockingIOError:
        reported = b""
    finally:
        os.close(call_status)
    return int.from_bytes(reported, "little") if len(reported) == 4 else init_status


def _call_namespace_init(
    sock: socket.socket, call_status: int, spare: Callable[[], NoReturn]
) -> NoReturn:
    """In a spare forked as the init of a pid namespace of its own: fork the process that waits
    for the call and runs it, reap every process of the namespace until that one ends, report
    its wait status on `call_status` and exit (the kernel then kills what is left inside).

    The call runs as pid 2, not as init: signals it sends itself, the worker's SIGTERM at the
    timeout and the kernel's SIGXCPU keep their default effect. This init holds no handler for
    any signal, so nothing inside the namespace can stop or kill it, and it leaves the process
    group to the call's process: the worker's group kills reach both.
    """
    try:
        os.setpgid(0, 0)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        drop_capabilities()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        call_pid = os.fork()
    except BaseException:  # noqa: BLE001 - nothing may unwind into the zygote's loop
        exit_setup_failed()
    if call_pid == 0:
        os.close(call_status)
        spare()
    sock.close()
    while True:
        pid, wait_status = os.wait()
        if pid == call_pid:
            os.write(call_status, wait_status.to_bytes(4, "little"))
            os._exit(0)


def _spare_main(
    sock: socket.socket,
    resolve: Callable[[bytes], ToolSpec],
    read_paths: tuple[str, ...],
    roots: tuple[ImportRoot, ...],
    zygote_pid: int,
    in_call_namespace: bool = False,
) -> NoReturn:
    """In a spare child: warm up, wait for the call from the worker, then run it like a direct
    child. Never returns. In a call namespace, its init (`zygote_pid`, 1 as well) is the parent
    and leads the process group."""
    called = False
    try:
        if not in_call_namespace:
            # A group of its own from the start, so that group kills reach it in any state.
            os.setpgid(0, 0)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote_pid:
            os._exit(0)
        rehearsed = _rehearse_until_called(sock, read_paths, roots, zygote_pid)
        message, fds = _receive_call(sock)
        prepared: SpareLayers | None = None
        ahead: ChildPlan | None = None
        confinement = None
        if not fds:
            # Layers to apply ahead of the call; the call itself comes next.
            arrived = step_end()
            prepared = SpareLayers.model_validate_json(message)
            if rehearsed is None:
                # The layers came first: a call's end confines its replacement as soon as the
                # zygote offers it, which cut the rehearsal short or came before it. Rehearse
                # now, before the layers (unless the call is here too): otherwise the first
                # pass over memory shared with the zygote falls to the call.
                rehearsed = _rehearse_until_called(sock, read_paths, roots, zygote_pid)
            if prepared.timings:
                steps = [("layers received", arrived)]
                if rehearsed is not None:
                    steps.append(("rehearsal", rehearsed))
                for step, at in sorted(steps, key=lambda ended: ended[1]):
                    start_timings(step, at)
            ahead = _plan(
                _REHEARSAL_TOOL,
                _SAMPLE.model_copy(update=dict(prepared)),
                (-1, -1, -1),
                read_paths,
                roots,
                zygote_pid,
            )
            confinement = confine_ahead(ahead)
            message, fds = _receive_call(sock)
        called = True
        received = step_end()
        if len(fds) != CALL_FD_COUNT:
            raise OSError(f"the call came with {len(fds)} descriptors, not {CALL_FD_COUNT}")
        output_fd, result_fd, control_fd, payload_fd = fds
        raw = os.pread(payload_fd, os.fstat(payload_fd).st_size, 0)
        call_fds = (output_fd, result_fd, control_fd)
        payload: CallArguments
        if ahead is None:
            whole = payload = CallPayload.model_validate_json(raw)
            plan = _plan(resolve(message), whole, call_fds, read_paths, roots, zygote_pid)
            if in_call_namespace:
                plan = replace(plan, process_group="inherited")  # its init leads the group
        else:
            # The worker chose this spare for layers planned as the call's would be: the plan it
            # was confined with takes the call's own part (each step here is on the call's path).
            payload = CallArguments.model_validate_json(raw)
            plan = _with_call(ahead, resolve(message), payload, call_fds)
        if payload.timings:
            if prepared is None and rehearsed is not None:
                start_timings("rehearsal", rehearsed)
            start_timings("call received", received)
            mark("payload read")
    except BaseException:  # noqa: BLE001 - nothing may unwind into the zygote's loop
        if not called and _let_go(sock):
            # The worker let this spare go while it confined itself (a stopping zygote releases
            # the spares' workdirs and cgroups): no call was coming, nothing to report.
            os._exit(0)
        exit_setup_failed()
    child_main(plan, confinement)


def _let_go(sock: socket.socket) -> bool:
    """Whether the worker closed this spare's call socket with no call left in it."""
    try:
        return select.select([sock], [], [], 0)[0] != [] and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return False


def _receive_call(sock: socket.socket) -> tuple[bytes, array.array[int]]:
    """The next message on the call socket and the descriptors it carries; exits at end of file
    (the worker let this spare go: it lacked a tool loaded since, or its layers did not fit)."""
    fds = array.array("i")
    message, ancillary, _flags, _address = sock.recvmsg(
        MAX_MESSAGE_BYTES, socket.CMSG_SPACE(CALL_FD_COUNT * fds.itemsize)
    )
    if not message:
        os._exit(0)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return message, fds


class _CallArrived(BaseException):
    """Raised by the SIGIO handler to cut a rehearsal short (BaseException: call_handler, which
    the rehearsal runs, turns every Exception into an outcome)."""


class _CallAlarm:
    """The SIGIO handler of a rehearsing spare: raises `_CallArrived` once, then never again.

    The worker sends a confined spare two messages back to back (its layers, then the call), so
    a second SIGIO can run this handler while the first `_CallArrived` is being handled; raising
    again there would escape the rehearsal and kill the spare before its call ran."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, _signum: int, _frame: object) -> None:
        if self.armed:
            self.armed = False
            raise _CallArrived


def _rehearse_until_called(
    sock: socket.socket,
    read_paths: tuple[str, ...],
    roots: tuple[ImportRoot, ...],
    zygote_pid: int,
) -> tuple[float, float] | None:
    """Rehearse a call while none is there; the call's arrival (SIGIO on the call socket) stops
    the rehearsal at once, so a call never waits for it. Whatever it left half done, the real
    call sets up again. When the rehearsal ended (monotonic, CPU seconds), or None if a message
    cut it short or was there before it."""
    ended = None
    alarm = _CallAlarm()
    fd = sock.fileno()
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        signal.signal(signal.SIGIO, alarm)
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC)
        if not select.select([sock], [], [], 0)[0]:
            sample = CallPayload.model_validate_json(_SAMPLE_PAYLOAD)
            CallArguments.model_validate_json(_SAMPLE_PAYLOAD)  # what a confined spare reads
            rehearse(
                _plan(
                    _REHEARSAL_TOOL, sample, (-1, -1, -1), read_paths, roots, zygote_pid
                )
            )
            ended = step_end()
        alarm.armed = False
    except _CallArrived:
        pass
    fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    return ended


class _CallPart(TypedDict):
    """The fields of a child's plan that come with the call, not with the spare's layers."""

    spec: ToolSpec
    args: str
    context: ToolContext
    timeout: float
    output_fd: int
    result_fd: int
    control_fd: int
    environment: dict[str, str]
    timings: bool


def _call_part(
    spec: ToolSpec, profile: SandboxProfile, call: CallArguments, fds: tuple[int, int, int]
) -> _CallPart:
    output_fd, result_fd, control_fd = fds
    return _CallPart(
        spec=spec.model_copy(update={"sandbox": profile, "timeout": call.timeout}),
        args=call.args_json,
        context=call.context,
        timeout=call.timeout,
        output_fd=output_fd,
        result_fd=result_fd,
        control_fd=control_fd,
        environment=call.environment,
        timings=call.timings,
    )


def _plan(
    spec: ToolSpec,
    payload: CallPayload,
    fds: tuple[int, int, int],
    read_paths: tuple[str, ...],
    roots: tuple[ImportRoot, ...],
    zygote_pid: int,
) -> ChildPlan:
    return ChildPlan(
        **_call_part(spec, payload.profile, payload, fds),
        workdir=payload.workdir,
        parent_pid=zygote_pid,
        drop_uid=payload.drop_uid,
        netns=payload.netns,
        landlock_abi=payload.landlock_abi,
        read_paths=(*read_paths, *payload.profile.read_paths),
        write_paths=payload.write_paths,
        seccomp_program=bytes.fromhex(payload.seccomp_program)
        if payload.seccomp_program
        else None,
        import_roots=roots if payload.drop_uid else (),
        required=payload.profile.required,
        cgroup_join=payload.cgroup_join,
        disk_quota=payload.disk_quota,
        hidden_paths=payload.hidden_paths,
        ipc_namespace=payload.ipc_namespace,
        # Already a group leader, in the zygote's session, which has no controlling terminal.
        process_group="own",
    )


def _with_call(
    ahead: ChildPlan, spec: ToolSpec, call: CallArguments, fds: tuple[int, int, int]
) -> ChildPlan:
    """The plan a spare was confined with (`_plan` of its layers), for the call that arrived: what
    `_plan` of the whole payload would give, without planning the layers again. Its process
    group is set up already (and seccomp, applied ahead, refuses setpgid)."""
    return replace(ahead, process_group="inherited", **_call_part(spec, ahead.profile, call, fds))


def _echo(text: str, ctx: ToolContext) -> str:
    """Return the text: the call spare children rehearse."""
    return text


_REHEARSAL_TOOL = tool(_echo, name="toolchord_rehearsal", side_effect="read")
_SAMPLE_PAYLOAD = CallPayload(
    args_json='{"text": "rehearsal"}',
    context=ToolContext(
        call_id="rehearsal",
        session_id="rehearsal",
        tool_name="toolchord_rehearsal",
        idempotency_key="rehearsal",
        deadline=0.0,
    ),
    profile=SandboxProfile(),
    timeout=1.0,
    workdir="/",
    environment={"PATH": "/usr/bin"},
    drop_uid=False,
    netns=False,
    landlock_abi=0,
    write_paths=("/dev/null",),
).model_dump_json()
_SAMPLE = CallPayload.model_validate_json(_SAMPLE_PAYLOAD)
"""Parsed once, in the zygote: a spare confined ahead only copies it with its layers."""


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data, socket.MSG_DONTWAIT)
    except OSError:
        pass  # the worker gave up on this call or spare, or is gone


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
