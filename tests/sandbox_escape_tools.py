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
