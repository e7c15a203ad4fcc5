"""The sandbox policy a tool declares (docs/sandbox.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Layer = Literal["rlimits", "uid", "landlock", "seccomp", "netns", "cgroup", "disk", "ipc"]
DirectFork = Literal["allow", "refuse"]
"""TOOLCHORD_SANDBOX_DIRECT_FORK: whether a tool the sandbox zygote cannot run may run in a
direct fork of the worker."""


class SandboxProfile(BaseModel):
    """How one tool's calls are isolated. Defaults are safe for typical API/DB tools."""

    model_config = ConfigDict(frozen=True)

    isolate: bool = Field(
        default=True, description="Run each call in its own child process."
    )
    network: bool = Field(
        default=True,
        description=(
            "False blocks socket() for every family (named Unix sockets too); "
            "socketpair() works."
        ),
    )
    filesystem: Literal["confined", "open"] = Field(
        default="confined",
        description="confined: read-only system paths, read-write per-call workdir only.",
    )
    read_paths: tuple[str, ...] = Field(
        default=(), description="Extra paths readable in confinement."
    )
    write_paths: tuple[str, ...] = Field(
        default=(), description="Extra paths writable in confinement."
    )
    memory_mb: int = Field(
        default=1024,
        ge=16,
        description=(
            "Memory of the call, in MiB. With the cgroup layer: the memory all of the call's "
            "processes use together. Always: RLIMIT_AS of each process is the size of the forked "
            "image (the zygote, or the worker on a direct fork) plus this, so a large worker does "
            "not starve small tools."
        ),
    )
    disk_mb: int = Field(
        default=256,
        ge=1,
        description=(
            "Bytes the call may write in its workdir, in MiB (the disk layer: a tmpfs of this "
            "size, which with the cgroup layer also counts against memory_mb)."
        ),
    )
    cpu_seconds: int | None = Field(
        default=None, description="RLIMIT_CPU; default: the tool's timeout + 1."
    )
    max_open_files: int = Field(default=256, ge=16)
    max_file_size_mb: int = Field(default=64, ge=1)
    max_processes: int = Field(default=64, ge=1)
    env_allow: tuple[str, ...] = Field(
        default=("PATH", "LANG", "LC_ALL", "TZ"),
        description="Environment variables copied from the worker; everything else is dropped.",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Fixed variables set for the child."
    )
    uid: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Unprivileged uid (and gid) the call runs as when the worker is root. None: a uid of "
            "its own per call, so concurrent calls cannot signal, trace or read each other."
        ),
    )
    required: frozenset[Layer] = Field(
        default=frozenset(),
        description="Layers that must be active: the call fails instead of running with a warning.",
    )
