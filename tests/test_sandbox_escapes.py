"""Escape attempts by a tool whose code is hostile, through the real sandbox: as a root worker
(calls drop to a per-call uid) and as an unprivileged worker (calls keep the worker's uid, so only
seccomp, Landlock and the zygote's pid namespace stand between a call and its zygote or worker).

The attacks live in tests/sandbox_escape_tools.py; the unprivileged worker is
tests/unprivileged_sandbox_worker.py, started as a uid of its own.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import sandbox_escape_tools as attacks
from tests import sandbox_tools
from tests.cluster_helpers import call, orchestrator
from tests.sandbox_tools import run
from tests.unprivileged_sandbox_worker import zombie_children
from toolchord.worker import ErrorCode
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.sandbox import probe, zygote
from toolchord.worker.sandbox.zygote import set_zygote_enabled, stop_zygote, zygote_pid

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
# A uid no other process on the machine uses: an attack that gets through kills nothing else.
UNPRIVILEGED_UID = 1_800_000_000 + os.getpid() % 100_000
DATABASE_SOCKETS = ("/run/mysqld/mysqld.sock", "/var/run/postgresql/.s.PGSQL.5432")
DENIED = {"EPERM", "EACCES", "ESRCH"}


@pytest.fixture(autouse=True)
def zygote_on() -> Iterator[None]:
    set_zygote_enabled(True)
    yield
    set_zygote_enabled(None)


@pytest.fixture
def fresh_zygote_client() -> Iterator[None]:
    """A zygote client without a history of deaths, and none left behind for later tests."""
    stop_zygote()
    zygote._client = None
    yield
    stop_zygote()
    zygote._client = None


@pytest.fixture
def unix_server() -> Iterator[str]:
    """A Unix stream socket anyone may connect to, outside every call's workdir (in a directory
    every uid can reach, as a database's socket directory is)."""
    directory = tempfile.mkdtemp(prefix="toolchord-test-sockets-")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "server.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(8)
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            connection.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield path
    stop.set()
    thread.join(2)
    server.close()
    shutil.rmtree(directory)


# -- an unprivileged worker ---------------------------------------------------------------------


def unprivileged_python() -> list[str] | None:
    """An interpreter the unprivileged uid can run with this environment's packages, or None.

    This interpreter may live under a private home; then a system interpreter of the same
    version runs with this environment's site-packages on PYTHONPATH."""
    candidates = [sys.executable]
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system:
        candidates.append(system)
    for candidate in candidates:
        try:
            probe_run = subprocess.run(
                [
                    candidate,
                    "-c",
                    "import sys, pydantic_core, pyseccomp, worker; print(sys.version_info[:2])",
                ],
                env=unprivileged_env(),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                **drop_to_unprivileged(),
            )
        except OSError:
            continue
        if probe_run.returncode == 0 and probe_run.stdout.strip() == str(
            sys.version_info[:2]
        ):
            return [candidate]
    return None


def unprivileged_env() -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *site.getsitepackages()]),
    }


def drop_to_unprivileged() -> dict[str, Any]:
    return {"user": UNPRIVILEGED_UID, "group": UNPRIVILEGED_UID, "extra_groups": []}


@pytest.fixture(scope="module")
def unprivileged_worker() -> Any:
    """Run calls in an unprivileged worker process; returns its header and one report per call."""
    if os.geteuid() != 0:
        pytest.skip("starting a worker as another uid needs root")
    python = unprivileged_python()
    if python is None:
        pytest.skip(
            "no interpreter with this environment's packages is usable by another uid"
        )

    def run_calls(
        calls: list[tuple[str, dict[str, Any]]],
        landlock: bool = True,
        concurrent: bool = False,
        env: dict[str, str] | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
        request = json.dumps(
            {"calls": calls, "landlock": landlock, "concurrent": concurrent}
        )
        finished = subprocess.run(
            [*python, "-m", "tests.unprivileged_sandbox_worker", request],
            env={**unprivileged_env(), **(env or {})},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            **drop_to_unprivileged(),
        )
        lines = [
            json.loads(line)
            for line in finished.stdout.splitlines()
            if line.startswith("{")
        ]
        assert lines, finished.stderr[-3000:]
        return lines[0], lines[1:], finished.returncode

    return run_calls


# -- limits and priority of other processes -----------------------------------------------------


def assert_only_own_process_changed(report: dict[str, str]) -> None:
    assert report["own setrlimit"] == "ok" and report["own nice"] == "ok", report
    others = {
        name: answer for name, answer in report.items() if not name.startswith("own")
    }
    assert others and all(answer in DENIED for answer in others.values()), others


def test_a_call_cannot_lower_the_limits_or_priority_of_its_zygote_or_worker() -> None:
    assert run(sandbox_tools.add, a=1, b=1).status == "ok"
    parent = zygote_pid()
    assert parent is not None
    before = resource.prlimit(parent, resource.RLIMIT_NOFILE)
    outcome = run(attacks.tamper_with_processes, pids=[parent, os.getpid()])
    assert outcome.status == "ok", outcome
    assert_only_own_process_changed(outcome.data)
    assert resource.prlimit(parent, resource.RLIMIT_NOFILE) == before


def test_unprivileged_a_call_cannot_lower_the_limits_or_priority_of_its_zygote_or_worker(
    unprivileged_worker: Any,
) -> None:
    header, reports, code = unprivileged_worker(
        [("tamper_with_processes", {"pids": ["$zygote", "$worker"]}), ("peaceful", {})]
    )
    assert header["uid"] == UNPRIVILEGED_UID and code == 0
    tamper, after = reports
    assert tamper["status"] == "ok", tamper
    assert_only_own_process_changed(tamper["data"])
    state = tamper["zygote_after"]
    assert state["alive"] and state["nofile"][0] > 3 and state["nice"] == 0, state
    # The zygote still forks children: the next call runs there, not in a fork of the worker.
    assert after["status"] == "ok" and after["zygote_now"] == header["zygote"], after


def test_a_zygote_that_cannot_offer_a_child_fails_the_call_and_is_restarted(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_zygote_client: None,
) -> None:
    """What a call that starves its zygote achieves: the next calls fail unrun, never fall back
    to a fork of the worker (whose memory holds its secrets), and a new zygote takes over.
    """
    monkeypatch.setattr(zygote, "REPLY_SECONDS", 2.0)
    assert run(sandbox_tools.add, a=1, b=1).status == "ok"
    starved = zygote_pid()
    assert starved is not None
    # Stopped: it forks no more spares and answers nothing, like a zygote starved of resources.
    os.kill(starved, signal.SIGSTOP)
    with caplog.at_level("WARNING", logger="toolchord.sandbox"):
        # At most the spares offered before the stop (two) serve calls.
        outcomes = [run(attacks.peaceful) for _ in range(3)]
    failed = [o for o in outcomes if o.status != "ok"]
    assert failed, "the spares ran out, so a call must have found no child"
    first = failed[0]
    assert (first.status, first.error_type, first.started, first.transient) == (
        "error",
        "SandboxUnavailable",
        False,
        True,
    ), first
    assert "not run" in (first.error_message or "")
    assert "direct fork" not in caplog.text
    assert f"sandbox zygote (pid {starved}) lost" in caplog.text
    deadline = time.monotonic() + 20
    while run(attacks.peaceful).status != "ok":
        assert time.monotonic() < deadline, "no new zygote took over"
    assert zygote_pid() not in (None, starved)


def test_a_zygote_that_keeps_dying_is_paused_not_disabled(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_zygote_client: None,
) -> None:
    """Before, a zygote killed four times within a minute was disabled for good and every later
    call ran in a fork of the worker; now calls fail until the deaths are old enough."""
    monkeypatch.setattr(zygote, "DEATHS_ALLOWED", 1)
    monkeypatch.setattr(zygote, "DEATH_WINDOW_SECONDS", 20.0)
    outcomes: list[HandlerOutcome] = []
    with caplog.at_level("WARNING", logger="toolchord.sandbox"):
        for _ in range(3):
            outcomes.append(run(sandbox_tools.add, a=1, b=1))
            pid = zygote_pid()
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    assert [o.status for o in outcomes[:2]] == ["ok", "ok"], outcomes
    paused = outcomes[2]
    assert (paused.status, paused.error_type, paused.started) == (
        "error",
        "SandboxUnavailable",
        False,
    )
    assert "next start in" in (paused.error_message or "")
    assert "direct fork" not in caplog.text
    # The deaths age out of the window: the zygote runs again.
    monkeypatch.setattr(zygote, "DEATH_WINDOW_SECONDS", 0.5)
    deadline = time.monotonic() + 10
    while run(sandbox_tools.add, a=1, b=1).status != "ok":
        assert time.monotonic() < deadline, "the zygote was never started again"
        time.sleep(0.2)
    assert zygote_pid() is not None


# -- signals ------------------------------------------------------------------------------------


def test_a_call_cannot_kill_its_zygote_its_worker_or_everyone() -> None:
    assert run(sandbox_tools.add, a=1, b=1).status == "ok"
    parent = zygote_pid()
    outcomes = [
        run(attacks.kill_parent),
        run(attacks.kill_pid, pid=os.getpid()),
        run(attacks.kill_everyone),
    ]
    assert [o.content for o in outcomes] == ["EPERM"] * 3, outcomes
    assert zygote_pid() == parent


@pytest.mark.parametrize("landlock", [True, False], ids=["landlock", "no-landlock"])
def test_unprivileged_a_call_cannot_kill_its_zygote_its_worker_or_everyone(
    unprivileged_worker: Any, landlock: bool
) -> None:
    header, reports, code = unprivileged_worker(
        [
            ("kill_parent", {}),
            ("kill_pid", {"pid": "$zygote"}),
            ("kill_pid", {"pid": "$worker"}),
            ("kill_everyone", {}),
            ("peaceful", {}),
        ],
        landlock=landlock,
    )
    assert code == 0, "the worker was killed"
    assert len(reports) == 5
    assert ("landlock" in reports[0]["sandbox_layers"]) is landlock
    for report in reports:
        assert report["status"] == "ok", report
        assert (
            report["zygote_after"]["alive"] and report["zygote_now"] == header["zygote"]
        ), report
    assert reports[3]["content"] == "EPERM"


def test_unprivileged_timeouts_kill_the_call_and_its_orphans_are_reaped(
    unprivileged_worker: Any,
) -> None:
    """Inside the zygote's pid namespace the worker still kills the right process group, and the
    zygote (the namespace's init) reaps the orphans of a call."""
    _, (stalled, orphans, after), code = unprivileged_worker(
        [("stall", {}), ("leave_orphans", {"count": 5}), ("peaceful", {})],
        landlock=False,
    )
    assert code == 0
    assert stalled["status"] == "timeout", stalled
    assert orphans["status"] == "ok" and after["status"] == "ok", (orphans, after)
    assert after["zygote_after"]["zombies"] == 0, after


def test_unprivileged_a_call_cannot_signal_or_see_a_sibling_call_or_the_spares(
    unprivileged_worker: Any,
) -> None:
    """Without Landlock's signal scoping, each call's own pid namespace is what keeps a call away
    from the other calls of its worker process and from the zygote's spare children."""
    with tempfile.TemporaryDirectory() as shared:
        os.chmod(shared, 0o777)
        path = os.path.join(shared, "sibling")
        _, (sibling, attacker), code = unprivileged_worker(
            [("wait_for_sibling", {"path": path}), ("kill_sibling", {"path": path})],
            landlock=False,
            concurrent=True,
        )
    assert code == 0
    assert attacker["status"] == "ok", attacker
    kills = attacker["data"]["kills"]
    assert kills and all(answer in DENIED for answer in kills.values()), attacker
    assert sibling["status"] == "ok" and sibling["content"] == "finished", sibling
    # Only the call's own namespace init (pid 1, the reaper of its namespace) besides itself.
    assert attacker["data"]["visible"] == [1], attacker


# -- children left to the zygote ----------------------------------------------------------------


def test_clone_parent_is_refused_so_the_zygote_keeps_no_zombies() -> None:
    assert run(sandbox_tools.add, a=1, b=1).status == "ok"
    parent = zygote_pid()
    assert parent is not None
    outcome = run(attacks.clone_parent, count=60)
    assert outcome.status == "ok", outcome
    assert outcome.data == {"made": 0, "refused": 60}
    assert zombie_children(parent) == 0


def test_unprivileged_clone_parent_is_refused(unprivileged_worker: Any) -> None:
    _, (report,), _ = unprivileged_worker(
        [("clone_parent", {"count": 20})], landlock=False
    )
    assert report["data"] == {"made": 0, "refused": 20}, report
    assert report["zygote_after"]["zombies"] == 0


# -- named Unix sockets with the network off ------------------------------------------------------


def test_named_unix_sockets_are_unreachable_with_the_network_off(
    unix_server: str,
) -> None:
    paths = [unix_server, *(p for p in DATABASE_SOCKETS if os.path.exists(p))]
    # With the network on a sandboxed call reaches them (neither uid nor Landlock stops it)...
    assert [run(attacks.unix_connect_with_network, path=p).content for p in paths] == [
        "ok"
    ] * len(paths)
    # ...with it off it cannot, while socketpair() still works.
    assert [run(attacks.unix_connect, path=p).content for p in paths] == [
        "EPERM"
    ] * len(paths)
    assert run(attacks.unix_socketpair).content == "ping"


def test_unprivileged_named_unix_sockets_are_unreachable_with_the_network_off(
    unprivileged_worker: Any, unix_server: str
) -> None:
    paths = [unix_server, *(p for p in DATABASE_SOCKETS if os.path.exists(p))]
    _, reports, _ = unprivileged_worker(
        [("unix_connect_with_network", {"path": p}) for p in paths]
        + [("unix_connect", {"path": p}) for p in paths]
    )
    contents = [r["content"] for r in reports]
    assert contents == ["ok"] * len(paths) + ["EPERM"] * len(paths), reports


# -- an unprivileged worker's calls own their mount and network namespaces ----------------------


def test_unprivileged_calls_have_a_disk_quota_no_network_and_no_view_of_the_worker_secrets(
    unprivileged_worker: Any, readable_secret: str, unix_server: str
) -> None:
    header, (filled, secret, offline), code = unprivileged_worker(
        [
            ("write_past_quota", {"megabytes": 32}),
            ("uncover_secret", {"path": readable_secret}),
            ("unix_connect", {"path": unix_server}),
        ],
        env={"TOOLCHORD_BROKER_URL_FILE": readable_secret},
    )
    if not header["disk"]["available"] and "user namespace:" in header["disk"]["detail"]:
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {header['disk']['detail']}")
    assert code == 0 and header["disk"]["available"], header
    # The workdir is a tmpfs of disk_mb (8): no more than 8 MB fit.
    assert filled["status"] == "ok" and "disk" in filled["sandbox_layers"], filled
    assert filled["data"]["answer"] == "ENOSPC" and filled["data"]["written"] <= 8, filled
    # The secret's directory is covered, and the call cannot take the cover off: it holds no
    # capability in its namespaces and may not make new ones.
    assert secret["status"] == "ok", secret
    assert secret["data"] == {"read": "ENOENT", "umount": "EPERM", "read after umount": "ENOENT",
                              "new user namespace": "EPERM"}, secret
    assert "netns" in offline["sandbox_layers"] and offline["content"] == "EPERM", offline
    with open(readable_secret) as still_there:
        assert "hunter2" in still_there.read()


# -- the worker decides whether a call started ---------------------------------------------------


def test_a_handler_cannot_claim_it_never_started() -> None:
    outcome = run(attacks.forge_not_started)
    assert (outcome.status, outcome.transient) == ("error", True), outcome
    assert outcome.started is True


def test_handlers_the_sandbox_stopped_count_as_started() -> None:
    """No frame at all, or one the worker refused: the start mark still says the handler ran."""
    for spec in (
        sandbox_tools.flood_stdout,
        sandbox_tools.die_by_signal,
        sandbox_tools.exit_quietly,
    ):
        outcome = run(spec)
        assert (outcome.status, outcome.started) == ("crashed", True), outcome


def test_unprivileged_a_handler_cannot_claim_it_never_started(
    unprivileged_worker: Any,
) -> None:
    _, (report,), _ = unprivileged_worker([("forge_not_started", {})], landlock=False)
    assert (report["status"], report["started"]) == ("error", True), report


@pytest.mark.skipif("netns" not in probe().available(), reason="needs the netns layer")
def test_a_child_refusing_before_the_handler_reports_not_started() -> None:
    """A required layer the child cannot apply (a network namespace is never planned for a
    network=True profile): the child refuses before the handler, and the worker believes it.
    """
    assert run(sandbox_tools.add, a=1, b=2).started is True
    profile = sandbox_tools.add.sandbox.model_copy(
        update={"required": frozenset({"netns"})}
    )
    refused = run(sandbox_tools.add.model_copy(update={"sandbox": profile}), a=1, b=2)
    assert (refused.error_type, refused.started) == (
        "SandboxUnavailable",
        False,
    ), refused


def test_an_unsafe_tool_forging_not_started_is_not_run_again(
    start_worker, redis_url, clean_redis
) -> None:
    start_worker("tests.celery_tools", concurrency=1)
    turn = orchestrator(redis_url).run_calls(
        "s-forge", [call(0, "forging_unsafe", key="forge")]
    )
    (result,) = turn.results
    assert result.attempts == 1 and result.error is not None, result
    assert result.error.code == ErrorCode.EXECUTION_ERROR
    assert int(clean_redis.get("tc-test:effects:forge")) == 1


# -- System V IPC is the call's own ------------------------------------------------------------


@pytest.fixture
def ipc_key() -> Iterator[int]:
    """A SysV IPC key no other test process uses; whatever a leaking call left under it is
    removed afterwards."""
    key = 0x7C000000 + os.getpid() % 0x100000
    attacks.remove_sysv(key)
    yield key
    attacks.remove_sysv(key)


def assert_host_has_no_ipc_object(key: int) -> None:
    for reader in (attacks.read_shm, attacks.read_msg):
        with pytest.raises(FileNotFoundError):
            reader(key)


def test_sysv_ipc_objects_end_with_the_call_that_made_them(ipc_key: int) -> None:
    if "ipc" not in probe().available():
        pytest.skip(f"no ipc layer here: {probe().ipc.detail}")
    planted = run(attacks.plant_sysv_ipc, key=ipc_key, text="tenant A's data")
    assert planted.status == "ok" and planted.data == {"shm": "ok", "msg": "ok"}, planted
    assert "ipc" in planted.sandbox_layers, planted
    # A later call (another tenant) finds nothing, and neither does the host.
    later = run(attacks.read_sysv_ipc, key=ipc_key)
    assert later.data == {"shm": "ENOENT", "msg": "ENOENT"}, later
    assert_host_has_no_ipc_object(ipc_key)


def test_without_an_ipc_namespace_seccomp_refuses_sysv_ipc(
    ipc_key: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a host where the call cannot have an IPC namespace of its own."""
    from toolchord.worker.sandbox import capabilities

    if "seccomp" not in probe().available():
        pytest.skip("needs the seccomp layer")
    caps = probe()
    monkeypatch.setattr(capabilities, "_cached", caps.model_copy(
        update={"ipc": caps.ipc.model_copy(update={"available": False, "detail": "off for this test"})}))
    planted = run(attacks.plant_sysv_ipc, key=ipc_key, text="tenant A's data")
    assert planted.data == {"shm": "EPERM", "msg": "EPERM"}, planted
    assert "ipc" not in planted.sandbox_layers, planted
    assert_host_has_no_ipc_object(ipc_key)


def test_unprivileged_sysv_ipc_objects_end_with_the_call_that_made_them(
    unprivileged_worker: Any, ipc_key: int
) -> None:
    _, (planted, later), code = unprivileged_worker(
        [
            ("plant_sysv_ipc", {"key": ipc_key, "text": "tenant A's data"}),
            ("read_sysv_ipc", {"key": ipc_key}),
        ]
    )
    assert code == 0 and planted["status"] == "ok", planted
    # An IPC namespace of the call's own, or (user namespaces refused) seccomp says no.
    if "ipc" in planted["sandbox_layers"]:
        assert planted["data"] == {"shm": "ok", "msg": "ok"}, planted
    else:
        assert planted["data"] == {"shm": "EPERM", "msg": "EPERM"}, planted
    assert later["data"] == {"shm": "ENOENT", "msg": "ENOENT"} or later["data"] == {
        "shm": "EPERM", "msg": "EPERM"}, later
    assert_host_has_no_ipc_object(ipc_key)


# -- kernel interfaces Landlock does not mediate ----------------------------------------------


def test_a_call_cannot_run_a_binary_from_a_memfd() -> None:
    outcome = run(attacks.exec_from_memfd)
    assert outcome.status == "ok", outcome
    assert outcome.data == {"memfd": "EPERM", "execveat": "EPERM"}, outcome


def test_a_call_cannot_watch_what_other_calls_create() -> None:
    from toolchord.worker.sandbox.workdir import sandbox_root

    outcome = run(attacks.watch_directories, paths=["/", "/etc", "/tmp", sandbox_root().path])
    assert outcome.status == "ok", outcome
    assert outcome.data == {"inotify": "EPERM", "fanotify": "EPERM"}, outcome


def test_a_direct_fork_cannot_push_input_into_a_terminal() -> None:
    set_zygote_enabled(False)  # a direct fork leads a session of its own: it can own a terminal
    outcome = run(attacks.inject_terminal_input)
    assert (outcome.status, outcome.content) == ("ok", "EPERM"), outcome


# -- the worker decides which layers applied and whether an error is transient ----------------


def test_a_handler_cannot_claim_layers_or_a_transient_failure() -> None:
    honest = run(sandbox_tools.add, a=1, b=1)
    outcome = run(attacks.forge_layers_and_transient)
    assert (outcome.status, outcome.error_type) == ("error", "PermissionError"), outcome
    assert outcome.transient is False, outcome
    # No network namespace is made for a tool with the network on, whatever the frame says.
    assert "netns" not in outcome.sandbox_layers, outcome
    assert outcome.sandbox_layers == honest.sandbox_layers, (outcome, honest)


@pytest.mark.skipif("disk" not in probe().available(), reason="needs the disk layer")
def test_a_secret_file_next_to_the_sandbox_root_is_covered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its directory holds every workdir, so it cannot be hidden: the file itself is."""
    from toolchord.worker.sandbox.workdir import sandbox_root

    directory = os.path.dirname(sandbox_root().path)
    fd, path = tempfile.mkstemp(prefix="toolchord-test-secret-", dir=directory)
    try:
        os.write(fd, b"redis://toolchord:hunter2@redis:6379/0")
        os.close(fd)
        os.chmod(path, 0o644)
        monkeypatch.setenv("TOOLCHORD_BROKER_URL_FILE", path)
        outcome = run(attacks.read_secret_file, path=path)
        assert outcome.status == "ok" and "hunter2" not in (outcome.content or ""), outcome
    finally:
        os.unlink(path)
