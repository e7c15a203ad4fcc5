"""What one process per call costs on this machine before the sandbox does anything: the floor
under `bench sandbox`'s CPU target.

Every sandboxed call runs in a process of its own forked from the zygote, and its workdir and
cgroup are made and removed by the worker. This module measures those parts alone, with nothing
of the sandbox or of toolchord's call code run: an interpreter that imports what the zygote
imports (the tool modules and toolchord's child code) forks children, and the worker's own
functions make and remove a call's cgroup and workdir. No design that keeps a process, a workdir
and a cgroup per call can cost less CPU per call than a child that runs the least a call can
(below) and that cgroup and workdir, on the same machine.

The children are forked with `os.fork()`, whose after-fork hooks (`threading`, `logging`, and
`random`'s reseeding, which keeps calls from sharing a generator's state) every Python child of
the zygote runs; a raw `fork` system call, which skips them, is measured beside it. A third kind
of child runs the least a call can: it parses its arguments into a pydantic model, builds its
result as another and writes that result's JSON to a pipe the forking process reads. Every
object such a child touches costs it a copy-on-write fault of the page holding it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from pydantic import BaseModel

from toolchord.worker.sandbox import cgroup
from toolchord.worker.sandbox.profile import SandboxProfile
from toolchord.worker.sandbox.workdir import make_workdir, remove_workdir

ZYGOTE_IMPORTS = ("toolchord.worker.sandbox.zygote_server",)
"""What the zygote imports besides the tool modules (the child's code comes with it)."""

_FORKS_SCRIPT = """\
import ctypes, gc, importlib, json, os, resource, sys
spec = json.loads(sys.argv[1])
sys.path[:] = spec["sys_path"]
for name in spec["modules"]:
    importlib.import_module(name)
if spec["call"]:
    from pydantic import BaseModel

    class Arguments(BaseModel):
        a: int
        b: int

    class Result(BaseModel):
        call_id: str
        value: int

def run_call():
    arguments = Arguments.model_validate_json('{"a": 2, "b": 3}')
    return Result(call_id="floor", value=arguments.a + arguments.b).model_dump_json().encode()

if spec["call"]:
    run_call()  # warm, as the zygote is: the models' validators built before the freeze
gc.freeze()
libc = ctypes.CDLL(None, use_errno=True)
SYS_fork, SYS_exit = 57, 60  # x86_64; the raw figure is skipped elsewhere

def fork_python():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    return pid

def fork_call():
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(writable, run_call())
        os._exit(0)
    os.close(writable)
    assert b'"value":5' in os.read(readable, 4096)
    os.close(readable)
    return pid

def fork_raw():
    pid = libc.syscall(SYS_fork)
    if pid == 0:
        libc.syscall(SYS_exit, 0)
    return pid

def measure(fork):
    self0, children0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(spec["forks"]):
        os.waitpid(fork(), 0)
    self1, children1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = lambda a, b: (b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime) * 1000 / spec["forks"]
    return {"parent_cpu_ms": cpu(self0, self1), "child_cpu_ms": cpu(children0, children1),
            "child_faults": (children1.ru_minflt - children0.ru_minflt) / spec["forks"]}

raw = os.uname().machine == "x86_64"
kinds = (fork_python, *([fork_call] if spec["call"] else []), *([fork_raw] if raw else []))
for fork in kinds:  # warm up
    for _ in range(20):
        os.waitpid(fork(), 0)
anonymous_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))
report = {"anonymous_mb": anonymous_kb / 1024, "python": measure(fork_python),
          "call": measure(fork_call) if spec["call"] else None, "raw": measure(fork_raw) if raw else None}
print(json.dumps(report))
"""


class ForkCost(BaseModel):
    """CPU and faults per fork, of one kind of child (see `ForkFloor`)."""

    parent_cpu_ms: float
    child_cpu_ms: float
    """The child's whole life: its side of the fork, the after-fork hooks (with `os.fork`), what
    it runs, its exit (tearing down its copy of the page tables)."""
    child_faults: float

    @property
    def total_ms(self) -> float:
        return self.parent_cpu_ms + self.child_cpu_ms


class ForkFloor(BaseModel):
    """Forks from an interpreter holding `modules`, reported by that interpreter as JSON."""

    anonymous_mb: float
    """The forking interpreter's anonymous resident memory (its page tables are what fork copies)."""
    python: ForkCost
    """With `os.fork()`, as the zygote forks."""
    call: ForkCost | None
    """With `os.fork()`, the child running the least a call can (see the module); measured from
    the zygote-like interpreter only, since it imports pydantic."""
    raw: ForkCost | None
    """With the bare `fork` system call and `_exit` (x86_64 only): the kernel's part alone."""


class ProcessFloor(BaseModel):
    """The floor of a process per call: the zygote-like fork, a bare interpreter's fork for
    comparison, and the worker's cgroup and workdir per call (None where cgroups are not usable)."""

    zygote_fork: ForkFloor
    bare_fork: ForkFloor
    cgroup_ms: float | None
    workdir_ms: float

    @property
    def total_ms(self) -> float:
        """CPU per call that no process-per-call design avoids here: a forked child that runs the
        least a call can, its cgroup and its workdir (the sandbox's layers not included)."""
        call = self.zygote_fork.call or self.zygote_fork.python
        return call.total_ms + (self.cgroup_ms or 0.0) + self.workdir_ms


def fork_floor(modules: Sequence[str], forks: int, *, call: bool) -> ForkFloor:
    """Fork `forks` children of each kind from a new `python -I` importing `modules`; with `call`,
    children that run the least a call can too."""
    spec = {
        "sys_path": [os.path.abspath(path) if path else os.getcwd() for path in sys.path],
        "modules": list(modules),
        "forks": forks,
        "call": call,
    }
    output = subprocess.run(
        [sys.executable, "-I", "-c", _FORKS_SCRIPT, json.dumps(spec)],
        check=True,
        capture_output=True,
        timeout=300,
    ).stdout
    return ForkFloor.model_validate_json(output)


def _thread_cpu_ms(action: Callable[[], object], times: int) -> float:
    start = time.thread_time()
    for _ in range(times):
        action()
    return (time.thread_time() - start) * 1000 / times


def measure_floor(tool_modules: Sequence[str], profile: SandboxProfile, forks: int) -> ProcessFloor:
    """Measure the floor of a process per call for a zygote of `tool_modules` (see the module)."""
    hierarchies = cgroup.hierarchies()
    cgroup_ms = (
        _thread_cpu_ms(lambda: cgroup.CallCgroup.create(hierarchies, profile).remove(), forks)
        if hierarchies
        else None
    )
    return ProcessFloor(
        zygote_fork=fork_floor([*tool_modules, *ZYGOTE_IMPORTS], forks, call=True),
        bare_fork=fork_floor([], forks, call=False),
        cgroup_ms=cgroup_ms,
        workdir_ms=_thread_cpu_ms(lambda: remove_workdir(make_workdir()), forks),
    )


def format_floor(
    floor: ProcessFloor, zygote_anonymous_mb: float | None, layers_ms: float, target_ms: float
) -> str:
    """The floor as the lines `bench sandbox` prints, ending with how it and the layers' CPU as
    profiled (`layers_ms`) stand to the target."""
    zygote = floor.zygote_fork
    seen = f"; the running zygote: {zygote_anonymous_mb:.1f} MB" if zygote_anonymous_mb else ""

    def fork_line(name: str, cost: ForkCost) -> str:
        return (
            f"    {name:38s}{cost.total_ms:8.3f} ms  (forking process {cost.parent_cpu_ms:.3f}, "
            f"child {cost.child_cpu_ms:.3f}, {cost.child_faults:.0f} faults in the child)"
        )

    lines = [
        "floor of a process per call on this machine (CPU per call, nothing of the sandbox run):",
        f"  fork from an interpreter with the zygote's imports "
        f"({zygote.anonymous_mb:.1f} MB anonymous{seen}):",
        fork_line("os.fork(), child exits at once", zygote.python),
    ]
    if zygote.raw is not None:
        lines.append(fork_line("raw fork system call (kernel alone)", zygote.raw))
    if zygote.call is not None:
        lines.append(fork_line("os.fork(), child runs a least call", zygote.call))
    lines.append(
        f"  the same from a bare interpreter ({floor.bare_fork.anonymous_mb:.1f} MB anonymous):"
    )
    lines.append(fork_line("os.fork(), child exits at once", floor.bare_fork.python))
    cgroup_text = f"{floor.cgroup_ms:.3f} ms" if floor.cgroup_ms is not None else "no cgroups here"
    lines.append(
        f"  the worker's cgroup per call (made with its limits, removed): {cgroup_text}; "
        f"workdir per call (made, removed): {floor.workdir_ms:.3f} ms"
    )
    with_layers = floor.total_ms + layers_ms
    left = target_ms - with_layers
    standing = (
        f"leaves {left:.3f} ms for the call's dispatch and the rest of the child"
        if left > 0
        else f"is {-left:.3f} ms above it: not reachable with a process per call on this machine"
    )
    lines.append(
        f"  floor: {floor.total_ms:.3f} ms per call (a least call's child, cgroup, workdir); with "
        f"the layers as profiled above ({layers_ms:.3f} ms): {with_layers:.3f} ms, which against "
        f"the CPU target ({target_ms:g} ms) {standing}"
    )
    return "\n".join(lines)
