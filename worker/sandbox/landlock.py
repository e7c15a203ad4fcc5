"""Landlock through its three syscalls, with ctypes.

Why not the PyPI `landlock` package: it is a development release (1.0.0.dev*) that only knows the
filesystem rights, while the sandbox also needs TCP bind/connect rules (ABI 4) and signal and
abstract-socket scoping (ABI 6). The kernel interface is three syscalls and three packed structs
that are ABI-stable by design (new rights are new bits, older kernels report a lower version), so a
small ruleset builder here is easier to audit than a pre-release dependency.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from toolchord.worker.sandbox.syscalls import syscall

# The generic syscall table gives Landlock the same numbers on every architecture.
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446

CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5

NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1

SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

_FS_V1 = (1 << 13) - 1
_FILE_ONLY_RIGHTS = (
    FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
)
READ_RIGHTS = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def abi_version() -> int:
    """The kernel's Landlock ABI version, or 0 when Landlock is missing or disabled.

    Asking the syscall is the only reliable probe: /sys/kernel/security/lsm is often not mounted.
    """
    try:
        return syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
            return 0
        raise


def fs_rights(abi: int) -> int:
    """Every filesystem right the given ABI knows (all of them are handled, i.e. denied by default)."""
    rights = _FS_V1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


@dataclass(frozen=True)
class LandlockPlan:
    """What one sandbox child restricts itself to."""

    confine_fs: bool
    read_paths: Sequence[str] = ()
    write_paths: Sequence[str] = ()
    read_fds: Sequence[int] = ()
    deny_tcp: bool = False
    scope_signals: bool = True
    scope_abstract_unix: bool = False


def restrict_self(abi: int, plan: LandlockPlan) -> list[str]:
    """Enforce the plan on the calling process (irreversible) and say which parts were applied.

    Missing paths are skipped. The caller must have set no_new_privs (or hold CAP_SYS_ADMIN).
    """
    applied: list[str] = []
    handled_fs = fs_rights(abi) if plan.confine_fs else 0
    handled_net = NET_BIND_TCP | NET_CONNECT_TCP if plan.deny_tcp and abi >= 4 else 0
    scoped = 0
    if abi >= 6:
        scoped |= SCOPE_SIGNAL if plan.scope_signals else 0
        scoped |= SCOPE_ABSTRACT_UNIX_SOCKET if plan.scope_abstract_unix else 0
    if not (handled_fs or handled_net or scoped):
        return applied
    attr = _RulesetAttr(handled_fs, handled_net, scoped)
    # Older kernels reject unknown trailing fields, so pass only the part of the struct they know.
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset_fd = syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    try:
        if handled_fs:
            _add_paths(ruleset_fd, plan.read_paths, READ_RIGHTS & handled_fs)
            _add_paths(ruleset_fd, plan.write_paths, handled_fs)
            for fd in plan.read_fds:
                _add_fd(ruleset_fd, fd, READ_RIGHTS & handled_fs)
            applied.append("fs")
        if handled_net:
            applied.append("tcp")
        if scoped:
            applied.append("scope")
        syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset_fd, 0)
    finally:
        os.close(ruleset_fd)
    return applied


def _add_paths(ruleset_fd: int, paths: Iterable[str], rights: int) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            _add_fd(ruleset_fd, fd, rights)
        finally:
            os.close(fd)


def _add_fd(ruleset_fd: int, fd: int, rights: int) -> None:
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        rights &= _FILE_ONLY_RIGHTS
    attr = _PathBeneathAttr(rights, fd)
    syscall(SYS_LANDLOCK_ADD_RULE, ruleset_fd, RULE_PATH_BENEATH, ctypes.byref(attr), 0)
