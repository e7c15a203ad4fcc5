"""The seccomp filter of a sandbox child: built once with libseccomp, loaded per child as raw BPF.

Importing pyseccomp and compiling a filter costs tens of milliseconds, loading a compiled program
costs microseconds; so each worker process compiles each variant it needs (network on/off, SysV IPC
allowed or not) once, keeps the BPF bytes, and a forked child only hands them to
prctl(PR_SET_SECCOMP).

The default action is allow; the listed calls fail with EPERM so a handler sees a clear
PermissionError instead of being killed. The filter only lists the native architecture, so
libseccomp's bad-architecture action kills calls made through a foreign ABI (e.g. int 0x80).

Integer arguments are compared on their low 32 bits where the kernel reads an `int` (a rule on
the full 64-bit value could be dodged by setting the upper half, which the kernel ignores); rules
of the form "any value but 0" compare all 64 bits, which only refuses more.
"""

from __future__ import annotations

import errno
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
    # Reach into other processes through a pidfd: take their descriptors, advise or reclaim
    # their memory, compare their kernel objects.
    "pidfd_getfd",
    "process_madvise",
    "process_mrelease",
    "kcmp",
    # Watching directories shows the names of files other calls (and the host) create in the
    # paths a call may read (/tmp, /etc, the sandbox root); Landlock does not mediate watches.
    "inotify_init",
    "inotify_init1",
    "fanotify_init",
)

# System V IPC and POSIX message queues live in the IPC namespace, not in the filesystem: without
# an IPC namespace of the call's own (the `ipc` layer), objects a call creates outlive it and
# other calls (other sessions) can attach them, so these calls are refused instead.
IPC_CALLS: tuple[str, ...] = (
    "shmget",
    "shmat",
    "shmdt",
    "shmctl",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "mq_open",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
)

# Calls whose first argument names the target process, 0 meaning the caller: any other value
# would let a call lower the limits, priority or CPU set of its zygote, its worker or another call
# of the same user (on an unprivileged worker all of them share the uid).
OWN_PROCESS_ONLY: tuple[str, ...] = (
    "prlimit64",
    "sched_setscheduler",
    "sched_setparam",
    "sched_setattr",
    "sched_setaffinity",
    "migrate_pages",
    "move_pages",
)
# setpriority(which, who, ...) and ioprio_set(which, who, ...): `who` must be 0 (the caller or its
# process group) and `which` must not name a whole user.
_PRIO_USER = 2
_IOPRIO_WHO_USER = 3
_LOW_32 = 0xFFFFFFFF
_SIGN_32 = 0x80000000
CLONE_PARENT = 0x00008000
"""A child made with CLONE_PARENT would be the zygote's (or worker's) child, left as a zombie."""
AT_EMPTY_PATH = 0x1000
"""execveat(fd, "", ..., AT_EMPTY_PATH) runs the file behind a descriptor: a memfd holding a
binary the call brought, which no Landlock path rule covers."""
MFD_NOEXEC_SEAL = 0x0008
"""memfd_create must ask for a memfd that can never be executed: an executable one would run a
binary the call brought through /proc/self/fd/N, a path Landlock does not see (kernels before 6.3
know no such flag and refuse it: there memfd_create fails)."""
# ioctl requests that push input into a terminal (TIOCSTI) or act on the console (TIOCLINUX):
# a call that gets hold of a terminal would type commands into its owner's shell.
TERMINAL_INJECTION_IOCTLS: tuple[int, ...] = (0x5412, 0x541C)

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
_programs: dict[tuple[bool, bool, bool], bytes] = {}


def compile_filter(network: bool, ipc_namespace: bool = True, memfd: bool = True) -> bytes:
    """The BPF program for a child with or without network access, in an IPC namespace of its
    own or not (then SysV IPC and POSIX message queues are refused), and with or without
    `memfd_create`; cached per process.

    Without a cgroup nothing bounds a call's memfd pages: they are neither address space
    (RLIMIT_AS) nor on a size-limited filesystem, and RLIMIT_FSIZE bounds each file, not their
    number. So a call without the cgroup layer gets `memfd=False` (EPERM)."""
    key = (network, ipc_namespace, memfd)
    with _lock:
        if key not in _programs:
            _programs[key] = _build(network, ipc_namespace, memfd)
        return _programs[key]


def _build(network: bool, ipc_namespace: bool, memfd: bool) -> bytes:
    import pyseccomp as seccomp

    deny = seccomp.ERRNO(errno.EPERM)
    filt = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in (*DENIED_CALLS, *(() if ipc_namespace else IPC_CALLS)):
        try:
            filt.add_rule(deny, name)
        except (OSError, ValueError):
            continue  # a call this architecture does not have
    filt.add_rule(deny, "execveat", seccomp.Arg(4, seccomp.MASKED_EQ, AT_EMPTY_PATH, AT_EMPTY_PATH))
    if memfd:
        filt.add_rule(deny, "memfd_create", seccomp.Arg(1, seccomp.MASKED_EQ, MFD_NOEXEC_SEAL, 0))
    else:
        filt.add_rule(deny, "memfd_create")
    for request in TERMINAL_INJECTION_IOCTLS:
        filt.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, _LOW_32, request))
    for flag in (*_CLONE_NAMESPACE_FLAGS, CLONE_PARENT):
        filt.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    for name in OWN_PROCESS_ONLY:
        filt.add_rule(deny, name, seccomp.Arg(0, seccomp.NE, 0))
    for name, whole_user in (("setpriority", _PRIO_USER), ("ioprio_set", _IOPRIO_WHO_USER)):
        filt.add_rule(deny, name, seccomp.Arg(1, seccomp.NE, 0))
        filt.add_rule(deny, name, seccomp.Arg(0, seccomp.MASKED_EQ, _LOW_32, whole_user))
    # kill(-1) signals every process the caller may signal, kill(-pgid) another process group
    # (the zygote's spares, other calls): only the own group (pid 0) and single processes remain.
    filt.add_rule(deny, "kill", seccomp.Arg(0, seccomp.MASKED_EQ, _SIGN_32, _SIGN_32))
    # clone3 passes its flags in memory that seccomp cannot inspect; ENOSYS makes libc fall back
    # to clone, whose flags are checked above.
    filt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    if not network:
        # Every family: UDP and raw sockets, which Landlock's TCP rules do not cover, and named
        # Unix sockets (a local database's), which no Landlock ABI up to 7 restricts. socketpair
        # is a separate call and stays allowed (asyncio's self-pipe, subprocess plumbing).
        filt.add_rule(deny, "socket")
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        return out.read()
