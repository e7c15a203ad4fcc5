"""Messages between the worker, its sandbox zygote and the zygote's children (JSON, never pickle).

All sockets are SOCK_SEQPACKET pairs, so every message arrives whole.

- Control socket: the worker sends `ZygoteInit` once and the zygote answers `ZygoteReady`. Then the
  worker sends `ZygoteRequest`s: fork spare children, or load a tool (with a reply socket as
  SCM_RIGHTS, answered by a `LoadReply`). For each spare the zygote sends a `SpareOffer` carrying
  two descriptors: the spare's call socket and its status socket.
- Call socket (worker -> spare): first, optionally, a `SpareLayers` without descriptors: the
  spare confines itself ahead of its call (cgroup, namespaces, workdir tmpfs, uid, Landlock,
  seccomp), and its call's memfd then holds only the `CallArguments`. Then the tool's
  `ToolLocator`, with the child ends of the output,
  result and cancel pipes and a memfd holding the `CallPayload`. The payload (arguments, context,
  the allowed environment values) is only ever read by the child that runs the call, so no call's
  data sits in the zygote's memory where a later child could find it.
- Status socket (zygote -> worker): `ZygoteReply(status=...)` once the zygote has killed what was
  left of the child's process group and reaped the child.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from toolchord.worker.context import ToolContext
from toolchord.worker.sandbox.profile import SandboxProfile

CALL_FD_COUNT = 4
"""Descriptors sent with each call: output, result and cancel pipes, payload memfd."""
OFFER_FD_COUNT = 2
"""Descriptors sent with each spare: its call socket and its status socket."""
MAX_MESSAGE_BYTES = 1 << 20


class ZygoteInit(BaseModel):
    """What a fresh zygote needs before it can serve calls."""

    sys_path: list[str] = Field(description="The worker's import path (absolute).")
    parent_pid: int = Field(
        description="The worker process; the zygote exits if it is gone."
    )
    modules: list[str] = Field(
        description="Tool modules to import before the first call."
    )
    spares: int = Field(
        description="Spare children to fork and offer right after start."
    )
    pid_namespace: bool = Field(
        default=False,
        description="Serve from a pid namespace of its own (with a user namespace when not root).",
    )


class ZygoteReady(BaseModel):
    """The zygote's answer to `ZygoteInit`."""

    pid: int = Field(description="The serving process, as the worker numbers it.")
    pid_namespace: str | None = Field(
        default=None,
        description="Why the zygote serves without the pid namespace it was asked for, if so.",
    )
    call_pid_namespaces: str | None = Field(
        default=None,
        description="Why the calls of an unprivileged worker's zygote, in its pid namespace, "
        "cannot each have a pid namespace of their own, if so.",
    )
    failed_modules: dict[str, str] = Field(
        default_factory=dict, description="Module name -> why it could not be imported."
    )


class ToolLocator(BaseModel):
    """Where the zygote finds a tool: a module-level ToolSpec, a tool of a module-level Registry,
    or (with `function_tool`, the tool's name) a module-level function it wraps with `tool()`."""

    module: str
    attribute: str = Field(description="Attribute of the module; a dotted qualname for a function.")
    registry_tool: str | None = None
    function_tool: str | None = None


class ZygoteRequest(BaseModel):
    """From the worker: fork `spares` more spare children, and/or load a tool (reply socket attached)."""

    spares: int = 0
    load: ToolLocator | None = None


class SpareOffer(BaseModel):
    """A spare child waiting for its call; `generation` tells which loads it has seen."""

    pid: int = Field(description="The spare, as the worker numbers it (its process group id).")
    generation: int


class LoadReply(BaseModel):
    """The zygote loaded the tool (spares of at least `generation` have it), or why not."""

    generation: int | None = None
    error: str | None = None


class SpareLayers(BaseModel):
    """The layers of a call that do not depend on its arguments: what a spare can apply before
    its call arrives (`CallPayload` carries them too)."""

    profile: SandboxProfile
    workdir: str
    drop_uid: bool
    netns: bool
    landlock_abi: int
    write_paths: tuple[str, ...]
    seccomp_program: str | None = Field(
        default=None, description="Prebuilt BPF program, hex; None: no seccomp layer."
    )
    cgroup_join: tuple[str, ...] = Field(
        default=(), description="Files the child writes 0 into to join its call's cgroup; empty: none."
    )
    disk_quota: bool = Field(
        default=False, description="Mount the workdir as a tmpfs of the profile's disk_mb."
    )
    hidden_paths: tuple[str, ...] = Field(
        default=(), description="Secret directories and files covered by empty ones (with disk_quota)."
    )
    ipc_namespace: bool = Field(
        default=False, description="Give the call an IPC namespace of its own."
    )
    timings: bool = Field(
        default=False,
        description="Benchmarks only: the child reports when each setup step ended (child.TIMINGS_PREFIX).",
    )


class CallArguments(BaseModel):
    """The part of a call that only the call has: all a spare confined ahead is sent."""

    args_json: str
    context: ToolContext
    timeout: float
    environment: dict[str, str] = Field(
        description="The worker's values of the profile's env_allow variables."
    )
    timings: bool = Field(
        default=False,
        description="Benchmarks only: the child reports when each setup step ended (child.TIMINGS_PREFIX).",
    )


class CallPayload(SpareLayers, CallArguments):
    """One call, as the worker prepared it, for a spare not confined ahead; read by the forked
    child only."""


class ZygoteReply(BaseModel):
    """The zygote's report on a child that ended: its wait status."""

    status: int
