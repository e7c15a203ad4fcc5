"""Handlers that misbehave are contained with a clear outcome, and the next call still works."""

from __future__ import annotations

import builtins
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import sandbox_tools as tools
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.sandbox import probe, run_isolated
from toolchord.worker.sandbox.runner import (
    GRACE_SECONDS,
    OUTPUT_FLOOD_BYTES,
    OUTPUT_KEEP_BYTES,
    RESULT_MAX_BYTES,
)
from toolchord.worker.sandbox.zygote import zygote_pid
from toolchord.worker.tools import ToolSpec

pytestmark = pytest.mark.slow
# Scheduling and fork time on a loaded CI machine: 0.94 s over timeout + grace seen with both cores busy.
SLACK = 2.0


def run(spec: ToolSpec, **arguments: Any) -> HandlerOutcome:
    return run_isolated(
        spec, spec.args_model(**arguments), tools.make_context(spec.name)
    )


@pytest.fixture(autouse=True)
def next_call_still_works(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    with caplog.at_level("WARNING", logger="toolchord.sandbox"):
        yield
        outcome = run(tools.add, a=20, b=22)
    # The reason first: pytest cuts a long message short.
    assert (outcome.status, outcome.content) == ("ok", "42"), (
        f"{outcome.error_type}: {outcome.error_message}; layers {outcome.sandbox_layers}; output {outcome.output!r}"
    )
    # The calls above ran in children of the zygote (the tools' module is importable by name),
    # and the zygote survived them.
    assert zygote_pid() is not None
    assert "direct fork" not in caplog.text and "zygote (pid" not in caplog.text


def confining() -> bool:
    available = probe().available()
    return "landlock" in available or "uid" in available


@pytest.fixture
def outside_file(tmp_path: Path) -> Path:
    """A world-readable file in a world-searchable directory, outside any call's workdir."""
    directory = tmp_path / "outside"
    directory.mkdir()
    target = directory / "secret.txt"
    target.write_text("not for tools")
    for path in (tmp_path, directory):
        path.chmod(0o755)
    target.chmod(0o644)
    return target


@pytest.mark.skipif(not confining(), reason="needs Landlock or the uid layer")
def test_reading_outside_the_workdir_is_denied(outside_file: Path) -> None:
    outcome = run(tools.read_file, path=str(outside_file))
    assert (outcome.status, outcome.error_type) == ("error", "PermissionError"), outcome
    assert "not for tools" not in (outcome.content or "") + outcome.output


@pytest.mark.skipif("landlock" not in probe().available(), reason="needs Landlock")
def test_writing_outside_the_workdir_is_denied(outside_file: Path) -> None:
    target = outside_file.parent / "planted.txt"
    outcome = run(tools.write_file, path=str(target), text="planted")
    assert (outcome.status, outcome.error_type) == ("error", "PermissionError"), outcome
    assert not target.exists()


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server, accepted
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


@pytest.mark.skipif(
    not {"seccomp", "netns", "landlock"} & probe().available(),
    reason="no network layer here",
)
def test_sockets_fail_with_network_off(
    listener: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, accepted = listener
    port = server.getsockname()[1]
    tcp = run(tools.connect, host="127.0.0.1", port=port)
    udp = run(tools.send_udp, host="127.0.0.1", port=port)
    assert tcp.status == "error" and udp.status == "error", (tcp, udp)
    for outcome in (tcp, udp):
        assert issubclass(
            getattr(builtins, outcome.error_type or "", type(None)), OSError
        ), outcome
    time.sleep(0.2)
    assert accepted == []


def test_sockets_work_with_network_on(
    listener: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, accepted = listener
    outcome = run(tools.connect_open, host="127.0.0.1", port=server.getsockname()[1])
    assert (outcome.status, outcome.content) == ("ok", "connected"), outcome
    deadline = time.monotonic() + 2
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(accepted) == 1


def test_worker_environment_is_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "hunter2-broker-password-7f3a"
    monkeypatch.setenv("TOOLCHORD_FAKE_BROKER_PASSWORD", secret)
    outcome = run(tools.environment, ppid=os.getpid())
    assert outcome.status == "ok", outcome
    assert secret not in (outcome.content or "")
    assert "TOOLCHORD_FAKE_BROKER_PASSWORD" not in outcome.data["environ"]
    assert set(outcome.data["environ"]) <= {
        "PATH",
        "LANG",
        "LC_ALL",
        "TZ",
        "HOME",
        "TMPDIR",
    }
    if confining():
        assert outcome.data["parent"].startswith("denied"), outcome.data["parent"][:80]


@pytest.mark.skipif(
    "uid" not in probe().available(), reason="RLIMIT_NPROC needs the uid layer as root"
)
def test_fork_bomb_is_capped_by_the_process_limit() -> None:
    outcome = run(tools.fork_bomb)
    assert (outcome.status, outcome.error_type) == ("error", "BlockingIOError"), outcome


def test_allocating_8_gib_fails_with_memory_error() -> None:
    outcome = run(tools.allocate, gib=8)
    assert (outcome.status, outcome.error_type) == ("error", "MemoryError"), outcome


def test_spinning_handler_times_out_within_timeout_plus_grace() -> None:
    start = time.monotonic()
    outcome = run(tools.spin)
    elapsed = time.monotonic() - start
    assert (outcome.status, outcome.error_type) == ("timeout", "TimeoutError"), outcome
    assert outcome.started
    assert 1.0 <= elapsed < 1.0 + GRACE_SECONDS + SLACK


def test_cpu_limit_stops_a_spinning_handler_before_its_wall_timeout() -> None:
    outcome = run(tools.spin_cpu_limited)
    assert (outcome.status, outcome.error_type) == ("crashed", "ChildCrashed"), outcome
    assert "SIGXCPU" in (outcome.error_message or "") and "CPU time limit" in (
        outcome.error_message or ""
    )


def test_sleeping_handler_times_out_with_partial_output() -> None:
    start = time.monotonic()
    outcome = run(tools.sleep_forever)
    assert outcome.status == "timeout", outcome
    assert outcome.output == "going to sleep\n"
    assert time.monotonic() - start < 1.0 + GRACE_SECONDS + SLACK


def test_handler_ignoring_sigterm_is_killed_after_the_grace_period() -> None:
    start = time.monotonic()
    outcome = run(tools.sleep_ignoring_term)
    elapsed = time.monotonic() - start
    assert outcome.status == "timeout", outcome
    assert 1.0 + GRACE_SECONDS - 0.1 <= elapsed < 1.0 + GRACE_SECONDS + SLACK


def test_stdout_flood_is_cut_off() -> None:
    outcome = run(tools.flood_stdout)
    assert (outcome.status, outcome.error_type) == ("crashed", "OutputLimitExceeded"), (
        outcome.error_message
    )
    assert str(OUTPUT_FLOOD_BYTES) in (outcome.error_message or "")
    assert len(outcome.output) < OUTPUT_KEEP_BYTES + 200
    assert "bytes of output dropped" in outcome.output


def test_child_killed_by_a_signal_is_reported() -> None:
    outcome = run(tools.die_by_signal)
    assert (outcome.status, outcome.error_type) == ("crashed", "ChildCrashed"), outcome
    assert outcome.error_message == "child killed by signal 11 (SIGSEGV)"


def test_child_exiting_without_a_result_is_reported() -> None:
    outcome = run(tools.exit_quietly)
    assert outcome.status == "crashed"
    assert outcome.error_message == "child exited with status 3 without a result"


def test_garbage_on_the_result_pipe_is_reported() -> None:
    outcome = run(tools.garbage_result)
    assert (outcome.status, outcome.error_type) == ("crashed", "ChildProtocolError"), (
        outcome
    )
    assert "unreadable result" in (outcome.error_message or "")


def test_oversized_result_is_refused() -> None:
    outcome = run(tools.huge_result)
    assert (outcome.status, outcome.error_type) == ("crashed", "ResultTooLarge"), (
        outcome
    )
    assert f"result exceeded {RESULT_MAX_BYTES} bytes" in (outcome.error_message or "")
