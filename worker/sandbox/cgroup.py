"""One cgroup per call: memory and process limits for the call as a whole, and a kill of every
process the call started, wherever it went.

RLIMIT_AS and RLIMIT_NPROC are per process (and NPROC per uid): a handler that forks N children
gets N times its memory. A cgroup counts the call's processes together. The worker creates the
call's cgroup (memory limit `memory_mb`, no swap, `pids.max` = `max_processes`) under its own
cgroup before the call starts; the child joins it first thing, before it runs anything of the
handler, so nothing of the call can be outside it. When the call ends the worker kills every
process left in it (grandchildren that left the process group included); a background thread
removes it once they are gone, off the call's path (`release_later`).

Hierarchies: cgroup v2 (`memory` and `pids` enabled in the worker's cgroup's subtree_control) or
the v1 `memory` and `pids` hierarchies. The layer is probed by doing it (a throwaway cgroup that a
forked child joins): in most containers cgroupfs is read-only, and an unprivileged worker can use
it only in a cgroup delegated to it.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass

from toolchord.worker.sandbox.limits import MIB
from toolchord.worker.sandbox.liveness import process_alive
from toolchord.worker.sandbox.profile import SandboxProfile

KILL_ROUNDS = 64
"""Read-and-kill passes before giving up on a call whose processes keep appearing."""

CALL_PREFIX = "toolchord-call-"
"""Call cgroups are named CALL_PREFIX + the worker process's pid + a counter."""
EXIT_WAIT_SECONDS = 1.0
"""How long a worker process that exits waits for the cgroups of its last calls to empty."""

_counter = itertools.count()
_lock = threading.Lock()
_pending_removal: list[CallCgroup] = []
# Held for a whole removal pass: a caller that finds nothing pending knows none is half removed.
_removing = threading.Lock()
_remover: tuple[int, threading.Event] | None = None
REMOVAL_RETRY_SECONDS = (0.005, 0.02, 0.1, 0.5)
"""Pauses of the background remover between passes while killed processes are still exiting."""
_found: tuple[int, tuple[Hierarchy, ...]] | None = None


@dataclass(frozen=True)
class Hierarchy:
    """Where this process's cgroup is in one mounted hierarchy."""

    version: int
    controller: str
    """"memory" or "pids" for v1; "" for v2 (both controllers in one directory)."""
    path: str


class CgroupUnavailable(OSError):
    """No writable cgroup hierarchy with memory and pids control for this process."""


def hierarchies() -> tuple[Hierarchy, ...]:
    """`find_hierarchies()`, cached per process (a forked worker process looks again)."""
    global _found
    with _lock:
        if _found is None or _found[0] != os.getpid():
            _found = (os.getpid(), find_hierarchies())
            _remove_stale(_found[1])
        return _found[1]


def _remove_stale(found: tuple[Hierarchy, ...]) -> None:
    """Kill and remove call cgroups of worker processes that died before removing them."""
    for hierarchy in found:
        try:
            names = os.listdir(hierarchy.path)
        except OSError:
            continue
        for name in names:
            owner = name.removeprefix(CALL_PREFIX).split("-")[0]
            if not name.startswith(CALL_PREFIX) or not owner.isdigit():
                continue
            if process_alive(int(owner)):
                continue
            stale = CallCgroup(((hierarchy, os.path.join(hierarchy.path, name)),))
            stale.kill_all()
            stale.remove()


def find_hierarchies() -> tuple[Hierarchy, ...]:
    """The writable place for call cgroups: one v2 directory, or the v1 memory and pids ones."""
    own = _own_cgroups()
    mounts = _cgroup_mounts()
    v2_mount = mounts.get("")
    if v2_mount is not None and "" in own:
        path = _join(v2_mount, own[""])
        if path is not None and _v2_usable(path):
            return (Hierarchy(2, "", path),)
    found = []
    for controller in ("memory", "pids"):
        if controller not in mounts or controller not in own:
            raise CgroupUnavailable(
                f"no cgroup v1 {controller} hierarchy and no cgroup v2 with memory and pids "
                "enabled for this process"
            )
        path = _join(mounts[controller], own[controller])
        if path is None or not os.access(path, os.W_OK):
            raise CgroupUnavailable(
                f"the worker's cgroup {path or own[controller]} ({controller}) is not writable "
                "(read-only cgroupfs, or not delegated to this user)"
            )
        found.append(Hierarchy(1, controller, path))
    return tuple(found)


def _own_cgroups() -> dict[str, str]:
    """Controller (v1) or "" (v2) -> this process's cgroup path in that hierarchy."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as lines:
        for line in lines:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """Controller (v1) or "" (v2) -> (mount root inside the hierarchy, mount point)."""
    mounts: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as lines:
        for line in lines:
            fields = line.split()
            separator = fields.index("-")
            fstype, options = fields[separator + 1], fields[separator + 3].split(",")
            root, point = fields[3], fields[4]
            if fstype == "cgroup2":
                mounts.setdefault("", (root, point))
            elif fstype == "cgroup":
                for controller in ("memory", "pids"):
                    if controller in options:
                        mounts.setdefault(controller, (root, point))
    return mounts


def _join(mount: tuple[str, str], own: str) -> str | None:
    root, point = mount
    if root == "/":
        return point + own.rstrip("/") if own != "/" else point
    if own == root or own.startswith(root.rstrip("/") + "/"):
        return point + own[len(root) :]
    return None  # this process's cgroup is not visible in the mount (another namespace)


def _v2_usable(path: str) -> bool:
    try:
        with open(os.path.join(path, "cgroup.subtree_control")) as control:
            enabled = set(control.read().split())
    except OSError:
        return False
    return {"memory", "pids"} <= enabled and os.access(path, os.W_OK)


class CallCgroup:
    """The cgroup (one directory per hierarchy) of one call."""

    def __init__(self, directories: tuple[tuple[Hierarchy, str], ...]) -> None:
        self.directories = directories

    @classmethod
    def create(
        cls, hierarchies: tuple[Hierarchy, ...], profile: SandboxProfile
    ) -> CallCgroup:
        """Make the call's cgroup with the profile's limits."""
        name = f"{CALL_PREFIX}{os.getpid()}-{next(_counter)}"
        made: list[tuple[Hierarchy, str]] = []
        cgroup = cls(())
        try:
            for hierarchy in hierarchies:
                directory = os.path.join(hierarchy.path, name)
                os.mkdir(directory)
                made.append((hierarchy, directory))
                cgroup.directories = tuple(made)
                _limit(hierarchy, directory, profile)
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    @property
    def join_files(self) -> tuple[str, ...]:
        """The files the (single-threaded) child writes "0" into to join: v1 `tasks`, which moves
        just the writing thread without the global lock a `cgroup.procs` write takes (that lock
        waits for an RCU grace period: 10 ms and more on a busy machine); v2 `cgroup.procs`."""
        return tuple(
            os.path.join(directory, "cgroup.procs" if hierarchy.version == 2 else "tasks")
            for hierarchy, directory in self.directories
        )

    def _memory_directory(self) -> tuple[Hierarchy, str] | None:
        for hierarchy, directory in self.directories:
            if hierarchy.controller in ("", "memory"):
                return hierarchy, directory
        return None

    def oom_kills(self) -> int:
        """Processes of the call the kernel killed for exceeding the memory limit so far."""
        found = self._memory_directory()
        if found is None:
            return 0
        hierarchy, directory = found
        name = "memory.events" if hierarchy.version == 2 else "memory.oom_control"
        try:
            # A raw read: this runs at the end of every call, and a text-mode open() (buffer,
            # decoder) costs several times the read itself.
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                counters = os.read(fd, 4096)
            finally:
                os.close(fd)
        except OSError:
            return 0
        for line in counters.splitlines():
            key, _, value = line.partition(b" ")
            if key == b"oom_kill":
                return int(value)
        return 0

    def kill_all(self) -> None:
        """SIGKILL every process in the cgroup, including those forked while it runs."""
        if not self.directories:
            return
        hierarchy, directory = self.directories[0]
        if hierarchy.version == 2:
            try:
                with open(os.path.join(directory, "cgroup.kill"), "w") as kill:
                    kill.write("1")
                return
            except OSError:
                pass  # kernels before 5.14: kill by pid
        killed: set[int] = set()
        for _ in range(KILL_ROUNDS):
            fresh = set(_read_pids(directory)) - killed
            if not fresh:
                return
            _kill_members(directory, fresh)
            killed |= fresh

    def remove(self) -> bool:
        """Remove the directories; False while killed processes are still exiting."""
        left = []
        for hierarchy, directory in self.directories:
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError:
                left.append((hierarchy, directory))
        self.directories = tuple(left)
        return not left


def _limit(hierarchy: Hierarchy, directory: str, profile: SandboxProfile) -> None:
    memory = str(profile.memory_mb * MIB)
    processes = str(profile.max_processes)
    if hierarchy.version == 2:
        _write(directory, "memory.max", memory)
        _write(directory, "memory.swap.max", "0", optional=True)
        # The kernel kills the whole call at the limit, not just its largest process.
        _write(directory, "memory.oom.group", "1", optional=True)
        _write(directory, "pids.max", processes)
    elif hierarchy.controller == "memory":
        _write(directory, "memory.limit_in_bytes", memory)
        # Without swap accounting the file is missing; with it, swap must not extend the limit.
        _write(directory, "memory.memsw.limit_in_bytes", memory, optional=True)
    else:
        _write(directory, "pids.max", processes)


def _write(directory: str, name: str, value: str, optional: bool = False) -> None:
    try:
        with open(os.path.join(directory, name), "w") as control:
            control.write(value)
    except (FileNotFoundError, PermissionError):
        if not optional:
            raise


def _kill_members(directory: str, pids: set[int]) -> None:
    """SIGKILL those of `pids` that are still in the cgroup: through a pidfd taken before
    checking, so that a pid reused meanwhile by another process is never signalled."""
    handles: dict[int, int] = {}
    for pid in pids:
        try:
            handles[pid] = os.pidfd_open(pid)
        except OSError:
            pass  # gone already
    try:
        members = set(_read_pids(directory))
        for pid, handle in handles.items():
            if pid in members:
                try:
                    signal.pidfd_send_signal(handle, signal.SIGKILL)
                except OSError:
                    pass
    finally:
        for handle in handles.values():
            os.close(handle)


def _read_pids(directory: str) -> list[int]:
    try:
        with open(os.path.join(directory, "cgroup.procs")) as procs:
            return [int(line) for line in procs if line.strip()]
    except OSError:
        return []


def release(cgroup: CallCgroup) -> None:
    """Kill what is left of the call and remove its cgroup, now or (still exiting) later."""
    cgroup.kill_all()
    if not cgroup.remove():
        with _lock:
            _pending_removal.append(cgroup)


def release_later(cgroup: CallCgroup) -> None:
    """Have this process's background thread kill what is left of the call and remove its cgroup:
    the rmdir (and for v1 the kill by pid) costs a few hundred microseconds, and the call's
    outcome does not depend on it. `remove_pending` finishes the job at once when asked."""
    global _remover
    with _lock:
        _pending_removal.append(cgroup)
        if _remover is None or _remover[0] != os.getpid():
            wake = threading.Event()
            threading.Thread(
                target=_remove_in_background,
                args=(wake,),
                name="toolchord-cgroup-removal",
                daemon=True,
            ).start()
            _remover = (os.getpid(), wake)
        wake = _remover[1]
    wake.set()


def _remove_in_background(wake: threading.Event) -> None:
    while True:
        wake.wait()
        wake.clear()
        for pause in REMOVAL_RETRY_SECONDS:
            if remove_pending():
                break
            time.sleep(pause)  # killed processes still exiting: their cgroup is not empty yet


def remove_pending() -> bool:
    """Remove the cgroups of ended calls (killing what is left in them) that are still there;
    True when none is left."""
    with _removing:
        with _lock:
            pending = list(_pending_removal)
            _pending_removal.clear()
        for cgroup in pending:
            release(cgroup)
        with _lock:
            return not _pending_removal


def remove_at_exit() -> None:
    """Remove what `remove_pending` can within EXIT_WAIT_SECONDS (calls' processes still exiting)."""
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    while not remove_pending() and time.monotonic() < deadline:
        time.sleep(0.01)


atexit.register(remove_at_exit)
# A forked process (a Celery pool child) leaves its parent's cgroups to the parent.
os.register_at_fork(after_in_child=_pending_removal.clear)


def join(join_files: tuple[str, ...]) -> None:
    """In the child, while it has a single thread: move it into the call's cgroup."""
    for path in join_files:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
