"""A per-call disk quota: the workdir is a tmpfs of `disk_mb`, mounted in a mount namespace of
the call's own.

RLIMIT_FSIZE bounds one file, not the total a handler writes. A root worker's child (before it
drops its uid) unshares its mount namespace, makes every mount in it private (nothing propagates
back to the host) and mounts a tmpfs with `size=` on its workdir. Only the call's processes see
that tmpfs; it disappears with the last of them, so what the call wrote never reaches the host's
disk and needs no removal. tmpfs pages are memory: with the cgroup layer they count against the
call's `memory_mb` too.
"""

from __future__ import annotations

from worker.sandbox.syscalls import (
    CLONE_NEWNS,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_REC,
    mount,
    unshare,
)


def mount_workdir(path: str, size_mb: int) -> None:
    """In the child: a private mount namespace with a `size_mb` tmpfs on `path` (mode 0700)."""
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=0700")
