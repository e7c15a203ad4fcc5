"""Per-call working directories: created in a private sandbox root, removed without following links.

The root is `$TOOLCHORD_SANDBOX_DIR`, by default `toolchord-sandbox-<euid>` in the system temporary
directory: never the temporary directory itself, which is shared with the whole host. It must be a
real directory owned by the worker's user and not writable by anyone else (checked on an open
descriptor, so a symlink planted in its place is refused); it is made searchable (not listable)
by other users so that the per-call uids reach their own workdir.

Removal works on descriptors from that root down (`openat`/`unlinkat`, `O_NOFOLLOW`): whatever the
handler left behind (its workdir removed, renamed, replaced by a symlink, directories of mode 0),
nothing above or outside the call's own workdir is ever changed. A workdir the handler moved
elsewhere (possible when the call has the worker's uid and no disk layer) is found again through
a descriptor held on it since its creation, and removed where it now is.

A workdir is named after the process that made it (`toolchord-call-<pid>.<pid namespace>-<random>`):
a worker process killed before it removed its workdirs (its spares', a call's in flight) leaves
them behind, and the next process to open the same root removes those of processes of its pid
namespace that are gone, in the background (`remove_stale`).
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import queue
import secrets
import stat
import tempfile
import threading
from dataclasses import dataclass

from toolchord.worker.sandbox.liveness import process_alive

WORKDIR_ROOT_ENV = "TOOLCHORD_SANDBOX_DIR"
WORKDIR_PREFIX = "toolchord-call-"
_ROOT_SEARCHABLE = stat.S_IXGRP | stat.S_IXOTH
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_log = logging.getLogger("toolchord.sandbox")
_lock = threading.Lock()
_root: SandboxRoot | None = None
_janitor: tuple[int, queue.Queue[Workdir]] | None = None


class SandboxRootError(OSError):
    """The sandbox root is missing, unsafe or unusable."""


@dataclass(frozen=True)
class SandboxRoot:
    """The directory all workdirs of this process live in, held open."""

    path: str
    fd: int
    owner: tuple[int, int, str]
    """(pid, euid, configured path) it was opened for: a forked or setuid'd process, or a new
    setting, opens and checks its own."""
    maker: str
    """`<pid>.<pid namespace>` of that process, the start of its workdirs' names after the prefix."""


@dataclass(frozen=True)
class Workdir:
    """One call's working directory: `path` for the child, (root, name) for the removal, and a
    descriptor `fd` on the directory itself, to find it wherever the call moved it."""

    root: SandboxRoot
    name: str
    fd: int

    @property
    def path(self) -> str:
        return os.path.join(self.root.path, self.name)


def default_root_path() -> str:
    """`toolchord-sandbox-<euid>` in the system temporary directory."""
    return os.path.join(tempfile.gettempdir(), f"toolchord-sandbox-{os.geteuid()}")


def configured_root_path() -> str:
    """The sandbox root the settings name now (`$TOOLCHORD_SANDBOX_DIR` or the default)."""
    return os.path.abspath(os.environ.get(WORKDIR_ROOT_ENV) or default_root_path())


def sandbox_root() -> SandboxRoot:
    """This process's sandbox root, created and checked on first use."""
    global _root
    path = configured_root_path()
    owner = (os.getpid(), os.geteuid(), path)
    with _lock:
        if _root is None or _root.owner != owner:
            # A replaced root's descriptor stays open: workdirs queued for removal still use it.
            _root = None
            _root = _open_root(path, owner)
            threading.Thread(target=remove_stale, args=(_root,), name="toolchord-workdir-sweep", daemon=True).start()
        return _root


def _open_root(path: str, owner: tuple[int, int, str]) -> SandboxRoot:
    try:
        os.mkdir(path, 0o711)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        raise SandboxRootError(
            exc.errno, f"sandbox directory {path} cannot be opened as a directory ({exc.strerror})"
        ) from exc
    try:
        info = os.fstat(fd)
        if info.st_uid != owner[1]:
            raise SandboxRootError(
                errno.EPERM,
                f"sandbox directory {path} belongs to uid {info.st_uid}, not to this worker "
                f"(uid {owner[1]}); set {WORKDIR_ROOT_ENV} to a private directory",
            )
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise SandboxRootError(
                errno.EPERM,
                f"sandbox directory {path} is writable by other users (mode "
                f"{stat.S_IMODE(info.st_mode):o}); set {WORKDIR_ROOT_ENV} to a private directory",
            )
        if info.st_mode & _ROOT_SEARCHABLE != _ROOT_SEARCHABLE:
            # The per-call uids must reach their workdir; listing the root stays denied.
            os.fchmod(fd, stat.S_IMODE(info.st_mode) | _ROOT_SEARCHABLE)
    except BaseException:
        os.close(fd)
        raise
    return SandboxRoot(path=path, fd=fd, owner=owner, maker=f"{owner[0]}.{_pid_namespace()}")


def make_workdir() -> Workdir:
    """A fresh, empty directory (mode 0700) for one call, named after this process."""
    root = sandbox_root()
    while True:
        name = f"{WORKDIR_PREFIX}{root.maker}-{secrets.token_hex(8)}"
        try:
            os.mkdir(name, 0o700, dir_fd=root.fd)
        except FileExistsError:
            continue
        return Workdir(root=root, name=name, fd=os.open(name, _DIR_FLAGS, dir_fd=root.fd))


def remove_stale(root: SandboxRoot) -> int:
    """Remove the workdirs in `root` made by processes of this pid namespace that are gone (a
    worker process killed before it removed them); return how many. A name whose process is alive,
    or one of another pid namespace (a root shared between containers), is left alone."""
    namespace = _pid_namespace()
    if not namespace:
        return 0  # which processes the names mean is unknown here
    removed = 0
    with os.scandir(root.fd) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        owner = _owner(name)
        if owner is None or owner[1] != namespace or process_alive(owner[0]):
            continue
        try:
            _remove_entry(root.fd, name)
        except FileNotFoundError:
            continue  # another process of the worker removed it first
        except OSError as exc:
            _log.warning("could not remove the stale sandbox workdir %s: %s", os.path.join(root.path, name), exc)
            continue
        removed += 1
    if removed:
        _log.info("removed %d sandbox workdirs of worker processes that are gone", removed)
    return removed


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _owner(name: str) -> tuple[int, int] | None:
    """(pid, pid namespace) of the process that made the workdir `name`, or None (not a workdir,
    or one named before workdirs carried their maker)."""
    owner, _, token = name.removeprefix(WORKDIR_PREFIX).rpartition("-")
    pid, _, namespace = owner.partition(".")
    if not name.startswith(WORKDIR_PREFIX) or not token or not pid.isdigit() or not namespace.isdigit():
        return None
    return int(pid), int(namespace)


def remove_workdir(workdir: Workdir) -> bool:
    """Remove the call's workdir and everything in it; True when it is gone.

    Never follows a symlink and never changes anything outside the workdir: a symlink (or any
    other non-directory) left under the workdir's name is unlinked, not followed.
    """
    try:
        parent_fd, name = _where_now(workdir)
        try:
            _remove_entry(parent_fd, name)
        finally:
            if parent_fd != workdir.root.fd:
                os.close(parent_fd)
    except OSError as exc:
        _log.warning("could not remove sandbox workdir %s: %s", workdir.path, exc)
        return False
    os.close(workdir.fd)
    return True


def _where_now(workdir: Workdir) -> tuple[int, str]:
    """(parent descriptor, name) of the workdir: its place in the root, or wherever the call moved
    it on the same filesystem, as the kernel names the directory behind `workdir.fd`. Only an
    entry that is that very directory is returned; anything else under the name is the root's."""
    own = os.fstat(workdir.fd)
    try:
        current = os.stat(workdir.name, dir_fd=workdir.root.fd, follow_symlinks=False)
        if (current.st_dev, current.st_ino) == (own.st_dev, own.st_ino):
            return workdir.root.fd, workdir.name
    except FileNotFoundError:
        pass
    moved_to = os.readlink(f"/proc/self/fd/{workdir.fd}")
    if own.st_nlink and not moved_to.endswith(" (deleted)") and os.path.isabs(moved_to):
        parent, name = os.path.split(moved_to)
        parent_fd = os.open(parent, _DIR_FLAGS)
        try:
            found = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            if (found.st_dev, found.st_ino) == (own.st_dev, own.st_ino):
                return parent_fd, name
        except FileNotFoundError:
            pass
        os.close(parent_fd)
    # Removed by the call (or moved where it cannot be named): whatever is under the name is
    # handled as before, never followed.
    return workdir.root.fd, workdir.name


def remove_workdir_later(workdir: Workdir) -> None:
    """Remove the workdir in this process's background thread, off the call's path.

    For workdirs that are a mount point in a call's mount namespace that may still be alive:
    removing one detaches that mount, which waits for an RCU grace period (milliseconds, more on
    a busy machine).
    """
    global _janitor
    with _lock:
        if _janitor is None or _janitor[0] != os.getpid():
            pending: queue.Queue[Workdir] = queue.Queue()
            threading.Thread(
                target=_remove_queued,
                args=(pending,),
                name="toolchord-workdir-removal",
                daemon=True,
            ).start()
            _janitor = (os.getpid(), pending)
        pending = _janitor[1]
    pending.put(workdir)


def _remove_queued(pending: queue.Queue[Workdir]) -> None:
    while True:
        workdir = pending.get()
        try:
            remove_workdir(workdir)
        finally:
            pending.task_done()


def wait_for_removals() -> None:
    """Return once every workdir handed to `remove_workdir_later` is removed (also at exit)."""
    janitor = _janitor
    if janitor is not None and janitor[0] == os.getpid():
        janitor[1].join()


atexit.register(wait_for_removals)


def _remove_entry(parent_fd: int, name: str) -> None:
    """Depth-first, without recursion (a handler may nest directories thousands deep)."""
    stack: list[tuple[int, str, int, list[str]]] = []
    try:
        _push_or_unlink(stack, parent_fd, name)
        while stack:
            parent, directory, fd, pending = stack[-1]
            if pending:
                _push_or_unlink(stack, fd, pending.pop())
                continue
            stack.pop()
            os.close(fd)
            _unlink(parent, directory, is_dir=True)
    finally:
        for _parent, _name, fd, _pending in stack:
            os.close(fd)


def _push_or_unlink(
    stack: list[tuple[int, str, int, list[str]]], parent_fd: int, name: str
) -> None:
    try:
        info = os.lstat(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        _unlink(parent_fd, name, is_dir=False)
        return
    fd = _open_dir(parent_fd, name, info)
    try:
        with os.scandir(fd) as entries:
            names = [entry.name for entry in entries]
    except BaseException:
        os.close(fd)
        raise
    stack.append((parent_fd, name, fd, names))


def _unlink(parent_fd: int, name: str, *, is_dir: bool) -> None:
    try:
        if is_dir:
            os.rmdir(name, dir_fd=parent_fd)
        else:
            os.unlink(name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass


def _open_dir(parent_fd: int, name: str, seen: os.stat_result) -> int:
    """Open a directory for listing and unlinking in it, giving its owner (us) rwx when needed.

    The mode is changed only through a descriptor of the very inode that was checked, never by
    path, so a directory swapped for a symlink cannot redirect the change elsewhere.
    """
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        # A directory the handler left unreadable (mode 0): its owner can restore access.
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        try:
            _check_same(handle, seen)
            os.chmod(f"/proc/self/fd/{handle}", stat.S_IRWXU)
            fd = os.open(f"/proc/self/fd/{handle}", _DIR_FLAGS & ~os.O_NOFOLLOW)
        finally:
            os.close(handle)
    try:
        _check_same(fd, seen)
        if os.geteuid() != 0 and stat.S_IMODE(seen.st_mode) & stat.S_IRWXU != stat.S_IRWXU:
            os.fchmod(fd, stat.S_IMODE(seen.st_mode) | stat.S_IRWXU)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_same(fd: int, seen: os.stat_result) -> None:
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino) or not stat.S_ISDIR(
        info.st_mode
    ):
        raise OSError(errno.ESTALE, "a directory was replaced while it was being removed")
