"""Tools that misbehave on purpose, for the sandbox tests (defined at module level, as users do)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

from toolchord.worker import SandboxProfile, ToolContext, tool

if TYPE_CHECKING:
    from toolchord.worker.execution import HandlerOutcome
    from toolchord.worker.tools import ToolSpec

FAST = SandboxProfile(memory_mb=256, max_processes=32)
NO_NET = SandboxProfile(network=False)


@tool(timeout=5, sandbox=FAST)
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool(timeout=5)
async def async_echo(text: str) -> str:
    """Echo text after an await."""
    await asyncio.sleep(0.01)
    return text.upper()


@tool(timeout=5)
def where_am_i(ctx: ToolContext) -> dict[str, object]:
    """Report the working directory and write a file there."""
    assert ctx.workdir is not None
    with open(os.path.join(ctx.workdir, "note.txt"), "w") as note:
        note.write("hello")
    return {
        "workdir": ctx.workdir,
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "uid": os.getuid(),
    }


@tool(timeout=5)
def read_file(path: str) -> str:
    """Read a file."""
    with open(path) as handle:
        return handle.read()


@tool(timeout=5)
def write_file(path: str, text: str) -> str:
    """Write a file."""
    with open(path, "w") as handle:
        handle.write(text)
    return "written"


@tool(timeout=5, sandbox=NO_NET)
def connect(host: str, port: int) -> str:
    """Open a TCP connection."""
    with socket.create_connection((host, port), timeout=1):
        return "connected"


@tool(timeout=5, sandbox=NO_NET)
def send_udp(host: str, port: int) -> str:
    """Send a UDP datagram."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"x", (host, port))
    return "sent"


@tool(timeout=5)
def connect_open(host: str, port: int) -> str:
    """Open a TCP connection with the network allowed."""
    with socket.create_connection((host, port), timeout=1):
        return "connected"


@tool(timeout=5, sandbox=SandboxProfile(env_allow=("PATH", "TOOLCHORD_TEST_CALL_VALUE")))
def call_facts(tag: str, ctx: ToolContext) -> dict[str, object]:
    """Report what reached the call itself: its argument, context, allowed variable and CPU limit."""
    import resource

    return {
        "tag": tag,
        "call_id": ctx.call_id,
        "deadline": ctx.deadline,
        "value": os.environ.get("TOOLCHORD_TEST_CALL_VALUE"),
        "cpu_limit": resource.getrlimit(resource.RLIMIT_CPU)[0],
        "pid": os.getpid(),
    }


@tool(timeout=5)
def environment(ppid: int) -> dict[str, object]:
    """Report the environment and try the worker's."""
    result: dict[str, object] = {"environ": dict(os.environ)}
    for name, path in (
        ("parent", f"/proc/{ppid}/environ"),
        ("self", "/proc/self/environ"),
    ):
        try:
            with open(path, "rb") as handle:
                result[name] = handle.read().decode("latin-1")
        except OSError as exc:
            result[name] = f"denied: {type(exc).__name__}"
    return result


@tool(timeout=5, sandbox=SandboxProfile(max_processes=16))
def fork_bomb() -> str:
    """Fork until something stops it."""
    while True:
        os.fork()


@tool(timeout=5, sandbox=SandboxProfile(memory_mb=256))
def allocate(gib: int) -> int:
    """Allocate memory."""
    block = bytearray(gib * 1024 * 1024 * 1024)
    return len(block)


@tool(timeout=1)
def spin() -> None:
    """Burn CPU forever."""
    while True:
        pass


@tool(timeout=5, sandbox=SandboxProfile(cpu_seconds=1))
def spin_cpu_limited() -> None:
    """Burn CPU until RLIMIT_CPU stops it."""
    while True:
        pass


@tool(timeout=1)
def sleep_forever() -> None:
    """Print something, then block forever."""
    print("going to sleep", flush=True)
    time.sleep(3600)


@tool(timeout=1)
def sleep_ignoring_term() -> None:
    """Ignore SIGTERM and block forever."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(3600)


@tool(timeout=10)
def flood_stdout() -> str:
    """Write 1 GiB to stdout."""
    chunk = "x" * (1024 * 1024)
    for _ in range(1024):
        sys.stdout.write(chunk)
    return "done"


@tool(timeout=5)
def chatty() -> str:
    """Print a little and return."""
    print("line one")
    print("line two", file=sys.stderr)
    return "ok"


@tool(timeout=5)
def die_by_signal() -> None:
    """Kill itself with SIGSEGV."""
    os.kill(os.getpid(), signal.SIGSEGV)


@tool(timeout=5)
def exit_quietly() -> None:
    """Exit without a result."""
    os._exit(3)


@tool(timeout=5)
def garbage_result() -> None:
    """Write garbage on the result pipe, then exit."""
    os.write(3, b"\x00not json{")
    os._exit(0)


@tool(timeout=5)
def huge_result() -> str:
    """Return more than the result limit."""
    return "y" * (20 * 1024 * 1024)


@tool(timeout=5)
def lazy_import() -> str:
    """Import stdlib modules that the worker has not imported."""
    import colorsys
    import email.mime.text
    import fractions

    return f"{colorsys.rgb_to_hsv(1, 0, 0)} {fractions.Fraction(1, 3)} {email.mime.text.MIMEText('x')['Content-Type']}"


@tool(timeout=5)
def run_shell(command: str) -> str:
    """Run a shell command."""
    import subprocess

    return subprocess.run(
        ["/bin/sh", "-c", command], capture_output=True, text=True, check=False
    ).stdout


@tool(timeout=5, sandbox=SandboxProfile(isolate=False))
def in_process() -> int:
    """Return the pid of the process running it."""
    return os.getpid()


@tool(timeout=5, sandbox=SandboxProfile(isolate=False, required=frozenset({"seccomp"})))
def in_process_requires() -> int:
    """Cannot run: requires a layer yet runs in-process."""
    return 1


@tool(timeout=5, cancellable=True)
def wait_for_cancel(ctx: ToolContext) -> str:
    """Poll the cancel flag."""
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        if ctx.cancelled:
            return "saw cancel"
        time.sleep(0.02)
    return "no cancel"


@tool(timeout=5, cancellable=True)
def ignore_cancel() -> str:
    """Sleep without looking at the cancel flag."""
    time.sleep(4)
    return "finished"


def make_context(name: str, cancel_after: float | None = None) -> ToolContext:
    """A context for one test call; optionally reporting cancellation after some seconds."""
    context = ToolContext(
        call_id=f"call-{name}",
        session_id="session-test",
        tool_name=name,
        idempotency_key=f"key-{name}",
        deadline=time.time() + 30,
    )
    if cancel_after is not None:
        cancel_at = time.monotonic() + cancel_after
        context.bind_cancel_check(lambda: time.monotonic() >= cancel_at)
    return context


def run(spec: ToolSpec, **arguments: object) -> HandlerOutcome:
    """One call of `spec` through the sandbox, with a test context."""
    from toolchord.worker.sandbox import run_isolated

    return run_isolated(spec, spec.args_model(**arguments), make_context(spec.name))


def run_in_pool_child(name: str) -> tuple[str, str | None, int]:
    """Run a tool through run_isolated from inside a (daemonic) pool process; for pool tests."""
    from toolchord.worker.sandbox import run_isolated

    spec = globals()[name]
    outcome = run_isolated(spec, spec.args_model(), make_context(name))
    return outcome.status, outcome.content, os.getpid()


OPEN_FS = SandboxProfile(filesystem="open")


@tool(timeout=5, sandbox=OPEN_FS)
def rename_own_workdir(to: str, ctx: ToolContext) -> str:
    """Move the call's workdir away (into the sandbox root's parent, say), so that a cleanup by
    name finds nothing to remove."""
    assert ctx.workdir is not None
    os.chdir("/")
    os.rename(ctx.workdir, to)
    return "renamed"


@tool(timeout=5, sandbox=OPEN_FS)
def replace_own_workdir(ctx: ToolContext) -> str:
    """Delete the call's own workdir and put a fresh directory in its place."""
    import shutil

    assert ctx.workdir is not None
    os.chdir("/")
    shutil.rmtree(ctx.workdir)
    os.mkdir(ctx.workdir)
    return "replaced"


@tool(timeout=5, sandbox=OPEN_FS)
def swap_workdir_for_symlink(target: str, ctx: ToolContext) -> str:
    """Delete the call's own workdir and leave a symlink to `target` in its place."""
    import shutil

    assert ctx.workdir is not None
    os.chdir("/")
    shutil.rmtree(ctx.workdir)
    os.symlink(target, ctx.workdir)
    return "swapped"


@tool(timeout=5)
def leave_unreadable_directory(ctx: ToolContext) -> str:
    """Leave a mode-0 directory (with a file in it) and a read-only one in the workdir."""
    assert ctx.workdir is not None
    for name, mode in (("locked", 0), ("readonly", 0o500)):
        path = os.path.join(ctx.workdir, name)
        os.makedirs(os.path.join(path, "inner"))
        with open(os.path.join(path, "inner", "file"), "w") as handle:
            handle.write("x")
        os.chmod(path, mode)
    return "left"


@tool(timeout=30, sandbox=SandboxProfile(memory_mb=512, max_processes=16))
def fork_and_allocate(children: int, megabytes: int) -> str:
    """Fork children that each fill `megabytes` of memory and hold it; count those that got there."""
    import select

    read_fd, write_fd = os.pipe()
    for _ in range(children):
        if os.fork() == 0:
            block = b"\x01" * (megabytes * 1024 * 1024)  # written, so really resident
            os.write(write_fd, b"1")
            time.sleep(60)
            os._exit(len(block) and 0)
    os.close(write_fd)
    held = 0
    deadline = time.monotonic() + 20
    while held < children and time.monotonic() < deadline:
        if select.select([read_fd], [], [], 0.5)[0]:
            held += len(os.read(read_fd, children))
    return f"{held} children held {megabytes} MB at once"


@tool(timeout=10, sandbox=SandboxProfile(disk_mb=8))
def fill_workdir(ctx: ToolContext, megabytes: int) -> int:
    """Write 1 MB files into the workdir until `megabytes` are written."""
    assert ctx.workdir is not None
    chunk = b"\x02" * (1024 * 1024)
    for index in range(megabytes):
        with open(os.path.join(ctx.workdir, f"part-{index}"), "wb") as handle:
            handle.write(chunk)
    return megabytes


@tool(timeout=5, sandbox=OPEN_FS)
def read_file_open(path: str) -> str:
    """Read a file with no Landlock filesystem rules."""
    with open(path) as handle:
        return handle.read()


@tool(timeout=5)
def escape_and_sleep() -> int:
    """Start a grandchild that leaves the process group (setsid) and sleeps; return its pid."""
    read_fd, write_fd = os.pipe()
    if os.fork() == 0:
        os.setsid()
        os.write(write_fd, str(os.getpid()).encode())
        time.sleep(60)
        os._exit(0)
    os.close(write_fd)
    return int(os.read(read_fd, 32))


def plain_parent_pid() -> int:
    """The pid of the process that forked this call; left undecorated so callers wrap it with
    `tool(...)` themselves."""
    return os.getppid()


@tool(timeout=10)
def hold_in_memfd(megabytes: int) -> int:
    """Hold `megabytes` in an anonymous memory file (memfd): memory that is not address space.
    Non-executable (MFD_NOEXEC_SEAL), the only kind the sandbox allows at all."""
    fd = os.memfd_create("hold", os.MFD_CLOEXEC | 0x0008)
    chunk = b"\x03" * (1024 * 1024)
    for _ in range(megabytes):
        os.write(fd, chunk)
    return os.fstat(fd).st_size
