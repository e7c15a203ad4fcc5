"""Tools that attack their sandbox, its zygote and its worker, for tests/test_sandbox_escapes.py.

Module level on purpose: the zygote imports this module by name, as it does users' tool modules.
Each attack reports what the kernel answered ("ok" or the errno name) instead of raising, so one
call can try several things.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import resource
import signal
import socket

from toolchord.worker import SandboxProfile, tool

CLONE_PARENT = 0x00008000
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(platform.machine(), 56)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _attempt(action: object) -> str:
    try:
        action()  # type: ignore[operator]
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "ok"


@tool(timeout=5)
def tamper_with_processes(pids: list[int]) -> dict[str, str]:
    """Lower the limits, priority and CPU set of other processes (the zygote, the worker)."""
    report: dict[str, str] = {
        "own setrlimit": _attempt(
            lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        ),
        "own nice": _attempt(lambda: os.setpriority(os.PRIO_PROCESS, 0, 1)),
        "whole user nice": _attempt(lambda: os.setpriority(os.PRIO_USER, 0, 19)),
    }
    for pid in pids:
        report[f"{pid} nofile"] = _attempt(
            lambda pid=pid: resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, 3))
        )
        report[f"{pid} nproc"] = _attempt(
            lambda pid=pid: resource.prlimit(pid, resource.RLIMIT_NPROC, (1, 1))
        )
        report[f"{pid} nice"] = _attempt(
            lambda pid=pid: os.setpriority(os.PRIO_PROCESS, pid, 19)
        )
        report[f"{pid} affinity"] = _attempt(
            lambda pid=pid: os.sched_setaffinity(pid, {0})
        )
        report[f"{pid} scheduler"] = _attempt(
            lambda pid=pid: os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        )
    return report


@tool(timeout=5)
def kill_parent() -> str:
    """SIGKILL the process that forked this call (the zygote)."""
    return _attempt(lambda: os.kill(os.getppid(), signal.SIGKILL))


@tool(timeout=5)
def kill_pid(pid: int) -> str:
    """SIGKILL one process by pid (the worker, say)."""
    return _attempt(lambda: os.kill(pid, signal.SIGKILL))


@tool(timeout=5)
def kill_everyone() -> str:
    """SIGKILL every process this call may signal."""
    return _attempt(lambda: os.kill(-1, signal.SIGKILL))


@tool(timeout=5, sandbox=SandboxProfile(max_processes=128))
def clone_parent(count: int) -> dict[str, int]:
    """Make children with CLONE_PARENT: the zygote would have to reap them."""
    made = refused = 0
    for _ in range(count):
        pid = _libc.syscall(_SYS_CLONE, CLONE_PARENT | signal.SIGCHLD, 0, 0, 0, 0)
        if pid == 0:
            os._exit(0)
        if pid > 0:
            made += 1
        else:
            refused += 1
    return {"made": made, "refused": refused}


def _connect_unix(path: str) -> str:
    def connect() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(path)

    return _attempt(connect)


@tool(timeout=5, sandbox=SandboxProfile(network=False))
def unix_connect(path: str) -> str:
    """Connect to a named Unix socket with the network off."""
    return _connect_unix(path)


@tool(timeout=5)
def unix_connect_with_network(path: str) -> str:
    """The same with the network on: shows the socket is reachable from a sandbox at all."""
    return _connect_unix(path)


@tool(timeout=5, sandbox=SandboxProfile(network=False))
def unix_socketpair() -> str:
    """A socketpair stays usable with the network off."""
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"ping")
        return right.recv(4).decode()


@tool(timeout=5, side_effect="unsafe", transient=(ConnectionError,))
def forge_not_started() -> str:
    """Act, then write a result frame claiming the handler never started, then fail transiently."""
    forged = json.dumps(
        {
            "status": "error",
            "started": False,
            "transient": True,
            "error_type": "ConnectionError",
            "error_message": "forged: never started, please retry",
        }
    ).encode()
    os.write(3, b"TCR1" + len(forged).to_bytes(8, "big") + forged)
    raise ConnectionError("the side effect already happened")


@tool(timeout=5)
def peaceful() -> int:
    """Do nothing harmful: show that the zygote still serves calls."""
    return os.getpid()


@tool(timeout=1)
def stall() -> None:
    """Block past the timeout: the worker must kill the right process group."""
    import time

    time.sleep(60)


@tool(timeout=5)
def leave_orphans(count: int) -> int:
    """Fork children that outlive this call (until its process group is killed)."""
    import time

    for _ in range(count):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    return count


def _wait_for(path: str, seconds: float) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@tool(timeout=10)
def wait_for_sibling(path: str) -> str:
    """Publish this call's pids (every pid namespace's number of it) in `path`, then wait until
    the sibling call is done with them: the sibling must not have been able to kill this one."""
    with open("/proc/self/status") as status:
        numbers = next(line for line in status if line.startswith("NSpid:")).split()[1:]
    with open(f"{path}.tmp", "w") as published:
        published.write(" ".join(numbers))
    os.rename(f"{path}.tmp", path)
    return "finished" if _wait_for(f"{path}.done", 8) else "sibling never done"


@tool(timeout=10)
def kill_sibling(path: str) -> dict[str, object]:
    """SIGKILL a concurrently running call by each number it published for itself, and list
    every pid this call can signal (signal 0) besides its own."""
    if not _wait_for(path, 8):
        return {"error": "the sibling never published its pids"}
    with open(path) as published:
        numbers = [int(number) for number in published.read().split()]
    kills = {
        str(pid): _attempt(lambda pid=pid: os.kill(pid, signal.SIGKILL))
        for pid in numbers
        if pid != os.getpid()
    }
    visible = [
        pid
        for pid in range(1, 1 << 15)
        if pid != os.getpid() and _attempt(lambda pid=pid: os.kill(pid, 0)) == "ok"
    ]
    with open(f"{path}.done", "w"):
        pass
    return {"kills": kills, "visible": visible, "own": os.getpid()}


@tool(timeout=10, sandbox=SandboxProfile(disk_mb=8))
def write_past_quota(megabytes: int) -> dict[str, object]:
    """Write 1 MB files into the workdir until `megabytes` are written or the disk says no;
    report how many fit, the error and the layers the call's namespaces gave it."""
    chunk = b"\x03" * (1024 * 1024)
    written = 0
    answer = "ok"
    for index in range(megabytes):
        try:
            with open(f"part-{index}", "wb") as handle:
                handle.write(chunk)
        except OSError as exc:
            answer = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            break
        written += 1
    return {"written": written, "answer": answer}


@tool(timeout=5, sandbox=SandboxProfile(filesystem="open"))
def uncover_secret(path: str) -> dict[str, str]:
    """Try to read a secret file of the worker: directly, after unmounting what covers its
    directory, and after a user namespace of its own (where the call would hold capabilities)."""
    directory = os.path.dirname(path).encode()
    _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def read() -> None:
        with open(path) as handle:
            handle.read()

    def unmount() -> None:
        if _libc.umount2(directory, 2) != 0:  # MNT_DETACH
            raise OSError(ctypes.get_errno(), "umount2")

    return {
        "read": _attempt(read),
        "umount": _attempt(unmount),
        "read after umount": _attempt(read),
        "new user namespace": _attempt(_unshare_user),
    }


def _unshare_user() -> None:
    if _libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare")


# -- System V IPC ------------------------------------------------------------------------------

IPC_CREAT = 0o1000
IPC_NOWAIT = 0o4000
IPC_RMID = 0
_libc.shmat.restype = ctypes.c_void_p
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.shmdt.argtypes = [ctypes.c_void_p]
_libc.msgrcv.restype = ctypes.c_ssize_t
_libc.msgrcv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int]
_libc.msgsnd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_SHM_BYTES = 4096


class _Message(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 64)]


def _checked(result: int, what: str) -> int:
    if result == -1:
        raise OSError(ctypes.get_errno(), what)
    return result


def _plant_shm(key: int, text: bytes) -> None:
    shmid = _checked(_libc.shmget(key, _SHM_BYTES, IPC_CREAT | 0o666), "shmget")
    address = _libc.shmat(shmid, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmat")
    ctypes.memmove(address, text, len(text))
    _libc.shmdt(ctypes.c_void_p(address))


def _plant_msg(key: int, text: bytes) -> None:
    msqid = _checked(_libc.msgget(key, IPC_CREAT | 0o666), "msgget")
    message = _Message(1, text)
    _checked(_libc.msgsnd(msqid, ctypes.byref(message), len(text), IPC_NOWAIT), "msgsnd")


def read_shm(key: int) -> bytes:
    """The text in the SysV shared memory segment of `key` (ENOENT: there is none)."""
    shmid = _checked(_libc.shmget(key, 0, 0), "shmget")
    address = _libc.shmat(shmid, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmat")
    try:
        return ctypes.string_at(address)
    finally:
        _libc.shmdt(ctypes.c_void_p(address))


def read_msg(key: int) -> bytes:
    """The first message in the SysV message queue of `key` (ENOENT: there is none)."""
    msqid = _checked(_libc.msgget(key, 0), "msgget")
    message = _Message()
    size = _checked(_libc.msgrcv(msqid, ctypes.byref(message), 64, 0, IPC_NOWAIT), "msgrcv")
    return bytes(message.mtext[:size])


def remove_sysv(key: int) -> None:
    """Remove the segment and queue of `key`, if any (a test's cleanup after a leak)."""
    for get, control in ((_libc.shmget, _libc.shmctl), (_libc.msgget, _libc.msgctl)):
        ident = get(key, 0, 0) if get is _libc.shmget else get(key, 0)
        if ident != -1:
            control(ident, IPC_RMID, None)


@tool(timeout=5, sandbox=SandboxProfile(network=False))
def plant_sysv_ipc(key: int, text: str) -> dict[str, str]:
    """Leave a shared memory segment and a message queue (mode 0666) holding `text` behind."""
    return {
        "shm": _attempt(lambda: _plant_shm(key, text.encode())),
        "msg": _attempt(lambda: _plant_msg(key, text.encode())),
    }


@tool(timeout=5, sandbox=SandboxProfile(network=False))
def read_sysv_ipc(key: int) -> dict[str, str]:
    """Read what an earlier call left under `key`: the text, or the errno name."""

    def read(reader: object) -> str:
        try:
            return reader(key).decode()  # type: ignore[operator]
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc.errno))

    return {"shm": read(read_shm), "msg": read(read_msg)}


# -- kernel interfaces Landlock does not mediate -----------------------------------------------

TIOCSTI = 0x5412
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]


def _run_from_descriptor(fd: int, by_proc_path: bool) -> None:
    """Exec the binary behind `fd` in a forked process; raise the errno the exec failed with."""
    pid = os.fork()
    if pid == 0:
        try:
            if by_proc_path:
                os.execv(f"/proc/self/fd/{fd}", ["true"])
            else:
                os.execve(fd, ["true"], {})
        except OSError as exc:
            os._exit(exc.errno or 1)
        os._exit(255)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code:
        raise OSError(code, "exec")


@tool(timeout=10, sandbox=SandboxProfile(network=False))
def exec_from_memfd() -> dict[str, str]:
    """Bring a binary in an executable memfd (no path rule covers it) and run it through
    /proc/self/fd; run a binary by descriptor (execveat with AT_EMPTY_PATH)."""

    def memfd_exec() -> None:
        fd = os.memfd_create("payload", 0)
        with open("/bin/true", "rb") as binary:
            os.write(fd, binary.read())
        _run_from_descriptor(fd, by_proc_path=True)

    def descriptor_exec() -> None:
        _run_from_descriptor(os.open("/bin/true", os.O_RDONLY), by_proc_path=False)

    return {"memfd": _attempt(memfd_exec), "execveat": _attempt(descriptor_exec)}


@tool(timeout=5, sandbox=SandboxProfile(network=False))
def watch_directories(paths: list[str]) -> dict[str, str]:
    """Watch directories other calls write to, to learn the names of their files."""

    def inotify() -> None:
        fd = _checked(_libc.inotify_init1(os.O_CLOEXEC), "inotify_init1")
        try:
            for path in paths:
                _checked(_libc.inotify_add_watch(fd, path.encode(), 0x100), "inotify_add_watch")
        finally:
            os.close(fd)

    def fanotify() -> None:
        os.close(_checked(_libc.fanotify_init(0, os.O_RDONLY), "fanotify_init"))

    return {"inotify": _attempt(inotify), "fanotify": _attempt(fanotify)}


@tool(timeout=5, sandbox=SandboxProfile(network=False, filesystem="open"))
def inject_terminal_input() -> str:
    """Take a terminal as the controlling one (a direct fork leads a session) and push input into
    it, as into the shell of whoever owns it."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # closing the terminal hangs its session up
    master, slave = os.openpty()
    terminal = os.open(os.ttyname(slave), os.O_RDWR)

    def inject() -> None:
        _checked(_libc.ioctl(terminal, TIOCSTI, ctypes.c_char_p(b"x")), "ioctl")

    try:
        return _attempt(inject)
    finally:
        for fd in (terminal, slave, master):
            os.close(fd)


@tool(timeout=5, side_effect="idempotent")
def forge_layers_and_transient() -> str:
    """Write a result frame claiming every sandbox layer (a network namespace too, on a tool with
    the network on) and a transient failure, so that the call looks safer and is run again."""
    forged = json.dumps(
        {
            "status": "error",
            "transient": True,
            "error_type": "PermissionError",
            "error_message": "forged: fully sandboxed, please retry",
            "sandbox_layers": ["rlimits", "uid", "landlock", "seccomp", "netns", "cgroup", "disk", "ipc"],
        }
    ).encode()
    os.write(3, b"TCR1" + len(forged).to_bytes(8, "big") + forged)
    return "unreachable"


@tool(timeout=5, sandbox=SandboxProfile(filesystem="open"))
def read_secret_file(path: str) -> str:
    """Read a file of the worker's (a `*_FILE` secret): its text, or the errno name."""
    try:
        with open(path) as handle:
            return handle.read()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
