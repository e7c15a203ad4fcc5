"""Thin ctypes wrappers for the Linux calls the sandbox (and the pool process's hard-limit watchdog,
worker/hard_limit.py) needs and Python 3.11 does not expose.

`os.unshare` only exists from Python 3.12 and `prctl` is not in the stdlib at all; going through
libc keeps the sandbox free of extra compiled dependencies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

PR_SET_PDEATHSIG = 1
PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CAP_SYS_ADMIN = 21
CLOCK_MONOTONIC = 1
_SIGEV_SIGNAL = 0
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [
    ctypes.c_int,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_libc.prctl.restype = ctypes.c_int
_libc.unshare.argtypes = [ctypes.c_int]
_libc.unshare.restype = ctypes.c_int
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.setns.restype = ctypes.c_int
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.mount.restype = ctypes.c_int


class _Sigevent(ctypes.Structure):
    # struct sigevent (64 bytes): the signal to send, and how (SIGEV_SIGNAL: to the process).
    _fields_ = [
        ("value", ctypes.c_void_p),
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("_pad", ctypes.c_int * 12),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


_libc.timer_create.argtypes = [ctypes.c_int, ctypes.POINTER(_Sigevent), ctypes.POINTER(ctypes.c_void_p)]
_libc.timer_create.restype = ctypes.c_int
_libc.timer_settime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
_libc.timer_settime.restype = ctypes.c_int


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def timer_create(clock: int, signo: int) -> ctypes.c_void_p:
    """timer_create(2) of a timer that sends `signo` to the process when it expires; raises OSError
    on failure. Forked children do not inherit it."""
    timer = ctypes.c_void_p()
    event = _Sigevent(signo=signo, notify=_SIGEV_SIGNAL)
    if _libc.timer_create(clock, ctypes.byref(event), ctypes.byref(timer)) != 0:
        _raise_errno("timer_create")
    return timer


def timer_settime(timer: ctypes.c_void_p, seconds: float) -> None:
    """timer_settime(2): expire once, `seconds` from now (0: never); raises OSError on failure."""
    whole = int(seconds)
    when = _Itimerspec(value=_Timespec(whole, int((seconds - whole) * 1e9)))
    if _libc.timer_settime(timer, 0, ctypes.byref(when), None) != 0:
        _raise_errno("timer_settime")


def prctl(
    option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0
) -> int:
    """prctl(2); raises OSError on failure."""
    result = _libc.prctl(option, arg2, arg3, arg4, arg5)
    if result < 0:
        _raise_errno(f"prctl({option})")
    return result


def unshare(flags: int) -> None:
    """unshare(2); raises OSError on failure."""
    if _libc.unshare(flags) != 0:
        _raise_errno("unshare")


def unshare_keeping_ids(flags: int) -> None:
    """unshare(2) with CLONE_NEWUSER added, the new user namespace mapping only the caller's own
    uid and gid to themselves: it grants nothing outside the namespaces it owns."""
    uid, gid = os.getuid(), os.getgid()
    unshare(flags | CLONE_NEWUSER)
    # A process that is not dumpable (after a uid change, or a worker hiding its memory) cannot
    # write its own maps: /proc/self is then root's. Dumpable only for these three writes.
    dumpable = prctl(PR_GET_DUMPABLE)
    if not dumpable:
        prctl(PR_SET_DUMPABLE, 1)
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as control:
                control.write(text)
    finally:
        if not dumpable:
            prctl(PR_SET_DUMPABLE, 0)


def setns(fd: int, nstype: int) -> None:
    """setns(2) (os.setns is Python 3.12+); raises OSError on failure."""
    if _libc.setns(fd, nstype) != 0:
        _raise_errno("setns")


def mount(
    source: str | None,
    target: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    """mount(2); raises OSError on failure."""

    def encode(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    if _libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        _raise_errno(f"mount {target}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities(keep: tuple[int, ...] = ()) -> None:
    """capset(2): effective and permitted sets reduced to `keep` (capability numbers), empty
    inheritable set; raises OSError on failure."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for capability in keep:
        bit = 1 << (capability % 32)
        data[capability // 32].effective |= bit
        data[capability // 32].permitted |= bit
    if _libc.capset(ctypes.byref(header), data) != 0:
        _raise_errno("capset")


def syscall(number: int, *args: Any) -> int:
    """A raw syscall with integer, None or ctypes pointer (byref) arguments; raises OSError on failure."""
    converted = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = _libc.syscall(ctypes.c_long(number), *converted)
    if result < 0:
        _raise_errno(f"syscall {number}")
    return int(result)


class SockFilter(ctypes.Structure):
    """struct sock_filter: one classic BPF instruction."""

    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class SockFprog(ctypes.Structure):
    """struct sock_fprog: the program handed to PR_SET_SECCOMP."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def load_seccomp_bpf(program: bytes) -> None:
    """Install a prebuilt seccomp BPF program for the calling thread (needs no_new_privs or CAP_SYS_ADMIN)."""
    count = len(program) // ctypes.sizeof(SockFilter)
    instructions = (SockFilter * count).from_buffer_copy(program)
    fprog = SockFprog(count, instructions)
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog))
