"""run_isolated: normal results, workdir lifecycle, in-process tools, output, cancellation, threads."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from tests import sandbox_tools as tools
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.sandbox import SandboxCapabilities, probe, run_isolated
from toolchord.worker.sandbox.workdir import wait_for_removals
from toolchord.worker.tools import ToolSpec


def run(spec: ToolSpec, **arguments: Any) -> HandlerOutcome:
    return run_isolated(
        spec, spec.args_model(**arguments), tools.make_context(spec.name)
    )


def test_sync_handler_returns_its_value() -> None:
    outcome = run(tools.add, a=2, b=40)
    assert outcome.status == "ok", outcome
    assert outcome.content == "42"
    assert outcome.data == 42
    assert "rlimits" in outcome.sandbox_layers


def test_async_handler_returns_its_value() -> None:
    outcome = run(tools.async_echo, text="quiet")
    assert (outcome.status, outcome.content) == ("ok", "QUIET")


def test_handler_runs_in_a_fresh_workdir_that_is_removed_afterwards() -> None:
    first = run(tools.where_am_i)
    second = run(tools.where_am_i)
    assert first.status == "ok", first
    assert first.data["cwd"] == first.data["workdir"]
    assert first.data["workdir"] != second.data["workdir"]
    assert first.data["pid"] != os.getpid()
    wait_for_removals()
    assert not os.path.exists(first.data["workdir"])
    assert not os.path.exists(second.data["workdir"])


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid layer needs a root worker")
def test_root_worker_runs_handlers_as_a_per_call_unprivileged_uid() -> None:
    first = run(tools.where_am_i)
    second = run(tools.where_am_i)
    assert "uid" in first.sandbox_layers
    assert first.data["uid"] != 0 and second.data["uid"] != 0
    assert first.data["uid"] != second.data["uid"]


def test_stdout_and_stderr_are_captured() -> None:
    outcome = run(tools.chatty)
    assert outcome.status == "ok"
    assert outcome.output == "line one\nline two\n"


def test_lazily_imported_stdlib_modules_still_load_in_the_child() -> None:
    outcome = run(tools.lazy_import)
    assert outcome.status == "ok", outcome
    assert "1/3" in (outcome.content or "")


def test_shell_commands_run_inside_the_sandbox() -> None:
    outcome = run(tools.run_shell, command="echo hello from sh")
    assert outcome.status == "ok", outcome
    assert outcome.content == "hello from sh\n"


def test_isolate_false_runs_in_this_process() -> None:
    outcome = run(tools.in_process)
    assert outcome.status == "ok"
    assert outcome.data == os.getpid()
    assert outcome.sandbox_layers == []


def test_isolate_false_with_required_layers_refuses_to_run() -> None:
    outcome = run(tools.in_process_requires)
    assert (outcome.status, outcome.error_type, outcome.started) == (
        "error",
        "SandboxUnavailable",
        False,
    )
    assert "seccomp" in (outcome.error_message or "")


def test_required_layer_that_is_unavailable_fails_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from toolchord.worker.sandbox import capabilities

    real = probe()
    without_landlock = real.model_copy(
        update={
            "landlock": real.landlock.model_copy(
                update={"available": False, "detail": "disabled for test"}
            )
        }
    )
    monkeypatch.setattr(capabilities, "_cached", without_landlock)
    spec = tools.add.model_copy(
        update={
            "sandbox": tools.add.sandbox.model_copy(
                update={"required": frozenset({"landlock"})}
            )
        }
    )
    outcome = run_isolated(spec, spec.args_model(a=1, b=1), tools.make_context("add"))
    assert (outcome.status, outcome.error_type, outcome.started) == (
        "error",
        "SandboxUnavailable",
        False,
    )
    assert "landlock" in (outcome.error_message or "") and "disabled for test" in (
        outcome.error_message or ""
    )


def test_cancel_is_visible_to_the_handler() -> None:
    spec = tools.wait_for_cancel
    outcome = run_isolated(
        spec, spec.args_model(), tools.make_context(spec.name, cancel_after=0.3)
    )
    assert (outcome.status, outcome.content) == ("ok", "saw cancel")


@pytest.mark.slow
def test_cancellable_handler_ignoring_cancel_is_stopped() -> None:
    spec = tools.ignore_cancel
    outcome = run_isolated(
        spec, spec.args_model(), tools.make_context(spec.name, cancel_after=0.2)
    )
    assert (outcome.status, outcome.error_type) == ("cancelled", "Cancelled")
    assert outcome.duration_ms < 3000


def test_concurrent_calls_from_threads() -> None:
    results: list[HandlerOutcome] = []
    lock = threading.Lock()

    def call(value: int) -> None:
        outcome = run(tools.add, a=value, b=1)
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(int(o.content or "-1") for o in results) == [1, 2, 3, 4, 5, 6]


def test_probe_is_cached_and_serializable() -> None:
    caps = probe()
    assert probe() is caps
    assert SandboxCapabilities.model_validate_json(caps.model_dump_json()) == caps
    assert caps.rlimits.available


def test_describe_layers_names_every_layer() -> None:
    from toolchord.worker.sandbox import describe_layers

    line = describe_layers()
    for layer in ("rlimits", "uid", "landlock", "seccomp", "netns", "cgroup", "disk"):
        assert layer in line


@pytest.mark.slow
def test_runs_from_a_daemonic_billiard_pool_child() -> None:
    """Celery's prefork pool children are daemonic; stdlib multiprocessing would refuse to fork there."""
    import billiard

    from toolchord.worker.sandbox import zygote_pid

    with billiard.get_context("fork").Pool(1) as pool:
        lazy = pool.apply(tools.run_in_pool_child, ("lazy_import",))
        spin = pool.apply(tools.run_in_pool_child, ("spin",))
        pool_zygote = pool.apply(zygote_pid)
    assert lazy[0] == "ok" and lazy[2] != os.getpid()
    assert spin[0] == "timeout"
    # The pool child started a zygote of its own (not the one of this process).
    assert pool_zygote is not None and pool_zygote != zygote_pid()


def test_with_only_rlimits_available_calls_still_run_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What an unprivileged worker in a locked-down container gets: rlimits and nothing else."""
    from toolchord.worker.sandbox import capabilities, runner

    real = probe()
    off = {"available": False, "detail": "off for test"}
    degraded = real.model_copy(
        update={
            layer: getattr(real, layer).model_copy(update=off)
            for layer in ("uid", "landlock", "seccomp", "netns", "cgroup", "disk", "ipc")
        }
    )
    monkeypatch.setattr(capabilities, "_cached", degraded)
    monkeypatch.setattr(runner, "_warned", set())
    monkeypatch.setenv("TOOLCHORD_FAKE_TOKEN", "tok-123")
    with caplog.at_level("WARNING", logger="toolchord.sandbox"):
        added = run(tools.add, a=1, b=2)
        env = run(tools.environment, ppid=os.getpid())
    assert (added.status, added.content, added.sandbox_layers) == (
        "ok",
        "3",
        ["rlimits"],
    )
    assert env.status == "ok" and "TOOLCHORD_FAKE_TOKEN" not in env.data["environ"]
    assert "tok-123" not in str(env.data["environ"])
    # The environment block the kernel set up at exec time is zeroed, not just unlinked.
    assert env.data["self"].strip("\x00") == ""
    warned = " ".join(record.getMessage() for record in caplog.records)
    for layer in ("uid", "landlock", "seccomp", "cgroup", "disk"):
        assert f"sandbox layer {layer} requested but unavailable" in warned
