"""Resource limits of a sandbox child (applied in the child, before it drops privileges)."""

from __future__ import annotations

import math
import os
import resource

from toolchord.worker.sandbox.profile import SandboxProfile

MIB = 1024 * 1024
NO_CGROUP_MAX_PROCESSES = 8
"""RLIMIT_NPROC of a call without the cgroup layer (at most): RLIMIT_AS is per process, so the
call's total address space is bounded by this many times (forked image + `memory_mb`)."""


def cpu_seconds(profile: SandboxProfile, timeout: float) -> int:
    """RLIMIT_CPU for a call: the profile's value, or the wall timeout + 1 (wall time stops it first)."""
    if profile.cpu_seconds is not None:
        return max(1, profile.cpu_seconds)
    return math.ceil(timeout) + 1


def mapped_bytes() -> int:
    """Address space already mapped in this (freshly forked) process."""
    with open("/proc/self/statm", "rb") as statm:
        pages = int(statm.read().split()[0])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _set(kind: int, soft: int, hard: int) -> None:
    """setrlimit, clamped to the current hard limit (an unprivileged worker cannot raise it)."""
    _, current_hard = resource.getrlimit(kind)
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(kind, (soft, hard))


def max_processes(profile: SandboxProfile, strict: bool) -> int:
    """RLIMIT_NPROC for a call; `strict` (no cgroup) caps it at NO_CGROUP_MAX_PROCESSES."""
    return min(profile.max_processes, NO_CGROUP_MAX_PROCESSES) if strict else profile.max_processes


def apply_rlimits(
    profile: SandboxProfile, timeout: float | None, strict_processes: bool = False
) -> None:
    """Set soft and hard limits; the hard ones cannot be raised again by the unprivileged child.

    `strict_processes`: the call has no cgroup but a uid of its own, so a low RLIMIT_NPROC
    bounds its total memory (see `max_processes`). `timeout` None: all but RLIMIT_CPU, which
    `apply_cpu_limit` sets once the call's timeout is known (it needs no /proc).
    """
    if timeout is not None:
        apply_cpu_limit(profile, timeout)
    address_space = mapped_bytes() + profile.memory_mb * MIB
    _set(resource.RLIMIT_AS, address_space, address_space)
    _set(resource.RLIMIT_NOFILE, profile.max_open_files, profile.max_open_files)
    file_size = profile.max_file_size_mb * MIB
    _set(resource.RLIMIT_FSIZE, file_size, file_size)
    processes = max_processes(profile, strict_processes)
    _set(resource.RLIMIT_NPROC, processes, processes)
    # A crashing handler must not leave core files (possibly holding worker secrets) behind.
    _set(resource.RLIMIT_CORE, 0, 0)


def apply_cpu_limit(profile: SandboxProfile, timeout: float) -> None:
    """RLIMIT_CPU for the call (soft limit -> SIGXCPU, one second later the hard limit -> SIGKILL)."""
    cpu = cpu_seconds(profile, timeout)
    _set(resource.RLIMIT_CPU, cpu, cpu + 1)
