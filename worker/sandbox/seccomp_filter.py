"""The seccomp filter of a sandbox child: built once with libseccomp, loaded per child as raw BPF.

Importing pyseccomp and compiling a filter costs tens of milliseconds, loading a compiled program
costs microseconds; so each worker process compiles the two variants (network on/off) once, keeps
the BPF bytes, and a forked child only hands them to prctl(PR_SET_SECCOMP).

The default action is allow; the listed calls fail with EPERM so a handler sees a clear
PermissionError instead of being killed. The filter only lists the native architecture, so
libseccomp's bad-architecture action kills calls made through a foreign ABI (e.g. int 0x80).
"""

from __future__ import annotations

import errno
import socket
import tempfile
import threading

# Calls a tool handler never needs and that would let it leave or inspect its sandbox: debugging
# other processes, new namespaces or mounts, kernel-side programs, io_uring (whose operations
# bypass seccomp's per-syscall checks), keyrings, and new sessions or process groups (which would
# let a grandchild escape the process-group kill on timeout).
DENIED_CALLS: tuple[str, ...] = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "swapoff",
    "reboot",
    "setsid",
    "setpgid",
)

_CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)

_lock = threading.Lock()
_programs: dict[bool, bytes] = {}


def compile_filter(network: bool) -> bytes:
    """The BPF program for a child with or without network access (cached per process)."""
    with _lock:
        if network not in _programs:
            _programs[network] = _build(network)
        return _programs[network]


def _build(network: bool) -> bytes:
    import pyseccomp as seccomp

    deny = seccomp.ERRNO(errno.EPERM)
    filt = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED_CALLS:
        try:
            filt.add_rule(deny, name)
        except (OSError, ValueError):
            continue  # a call this architecture does not have
    for flag in _CLONE_NAMESPACE_FLAGS:
        filt.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory that seccomp cannot inspect; ENOSYS makes libc fall back
    # to clone, whose flags are checked above.
    filt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    if not network:
        # Covers UDP and raw sockets too, which Landlock's TCP rules do not.
        filt.add_rule(deny, "socket", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        return out.read()
