"""A pool process that ends (a warm stop, a recycled process) leaves none of its sandbox behind:
the spares its zygote confined ahead of their calls hold a workdir and a cgroup each, and a Celery
pool process ends with `os._exit`, past the exit hooks that would remove them. What a killed one
leaves, the next worker process on the same sandbox root removes."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cluster_helpers import TOOLS, call, orchestrator, wait_for
from toolchord.orchestrator.bench.processes import WorkerProcess
from toolchord.worker.sandbox import cgroup
from toolchord.worker.sandbox.capabilities import probe
from toolchord.worker.sandbox.workdir import WORKDIR_ROOT_ENV, make_workdir, remove_stale, remove_workdir, sandbox_root
from toolchord.worker.sandbox.zygote import SPARES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def _pool_pids(worker: WorkerProcess) -> set[int]:
    assert worker.proc is not None
    children = Path(f"/proc/{worker.proc.pid}/task/{worker.proc.pid}/children").read_text().split()
    return {int(pid) for pid in children}


def _call_cgroups(pids: set[int]) -> list[Path]:
    """The call cgroups made by these processes (each is named after the process that made it)."""
    prefixes = tuple(f"{cgroup.CALL_PREFIX}{pid}-" for pid in pids)
    return [entry for hierarchy in cgroup.find_hierarchies() for entry in Path(hierarchy.path).iterdir()
            if entry.name.startswith(prefixes)]


def _workdirs(root: Path) -> set[str]:
    return {p.name for p in root.glob("toolchord-call-*")}


def test_a_worker_stopped_warm_leaves_no_workdir_or_cgroup_of_its_spares(
        start_worker: Callable[..., WorkerProcess], redis_url: str, tmp_path: Path) -> None:
    root = tmp_path / "sandbox"
    worker = start_worker(TOOLS, concurrency=2, TOOLCHORD_SANDBOX_DIR=str(root))
    pool = _pool_pids(worker)
    turn = orchestrator(redis_url).run_calls("s-exit", [call(i, "echo", text=str(i)) for i in range(4)])
    assert [r.content for r in turn.results] == ["0", "1", "2", "3"]
    # Spares confined ahead for the next calls hold their workdirs (and cgroups) now.
    wait_for(lambda: bool(_workdirs(root)), 30, "spares confined ahead of their calls")
    with_cgroups = "cgroup" in probe().available()
    if with_cgroups:
        assert _call_cgroups(pool)
    worker.stop()
    assert worker.proc is not None and worker.proc.returncode == 0
    assert _workdirs(root) == set()
    if with_cgroups:
        assert _call_cgroups(pool) == []


def test_pool_processes_recycled_after_each_task_leave_no_workdirs_behind(
        start_worker: Callable[..., WorkerProcess], redis_url: str, tmp_path: Path) -> None:
    # Each pool process runs one task and ends (Celery's --max-tasks-per-child): the spares it had
    # confined after its call go with it, so the root never holds more than one zygote's spares.
    root = tmp_path / "sandbox"
    start_worker(TOOLS, concurrency=1, args=["--max-tasks-per-child", "1"], TOOLCHORD_SANDBOX_DIR=str(root))
    orch = orchestrator(redis_url)
    held = []
    for i in range(3):
        turn = orch.run_calls(f"s-recycled-{i}", [call(0, "echo", text=str(i))])
        assert turn.results[0].content == str(i)
        held.append(len(_workdirs(root)))
    assert max(held) <= SPARES, held


def test_a_killed_worker_s_workdirs_and_cgroups_are_removed_by_the_next_worker(
        start_worker: Callable[..., WorkerProcess], redis_url: str, tmp_path: Path) -> None:
    root = tmp_path / "sandbox"
    killed = start_worker(TOOLS, concurrency=2, name="killed", TOOLCHORD_SANDBOX_DIR=str(root))
    orch = orchestrator(redis_url)
    assert orch.run_calls("s-killed", [call(0, "echo", text="a")]).results[0].content == "a"
    wait_for(lambda: bool(_workdirs(root)), 30, "spares confined ahead of their calls")
    killed_pool = _pool_pids(killed)
    killed.kill()
    left = _workdirs(root)
    assert left
    with_cgroups = "cgroup" in probe().available()
    if with_cgroups:
        assert _call_cgroups(killed_pool)
    start_worker(TOOLS, concurrency=2, name="next", TOOLCHORD_SANDBOX_DIR=str(root))
    assert orch.run_calls("s-next", [call(0, "echo", text="b")]).results[0].content == "b"
    wait_for(lambda: not left & _workdirs(root), 30, "the killed worker's workdirs to be removed")
    if with_cgroups:
        wait_for(lambda: not _call_cgroups(killed_pool), 30, "the killed worker's call cgroups to be removed")


@pytest.fixture
def own_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(WORKDIR_ROOT_ENV, str(tmp_path / "root"))
    yield tmp_path / "root"


def test_only_workdirs_of_processes_of_this_namespace_that_are_gone_are_removed(own_root: Path) -> None:
    root = sandbox_root()
    namespace = os.stat("/proc/self/ns/pid").st_ino
    ended = subprocess.Popen(["true"])
    ended.wait()
    mine = make_workdir()
    assert mine.name.startswith(f"toolchord-call-{os.getpid()}.{namespace}-")

    def planted(owner: str) -> str:
        name = f"toolchord-call-{owner}{secrets.token_hex(8)}"
        (own_root / name / "deep").mkdir(parents=True)
        (own_root / name / "deep" / "left.txt").write_text("x")
        return name

    gone = planted(f"{ended.pid}.{namespace}-")
    kept = {mine.name, planted(f"1.{namespace}-"), planted(f"{ended.pid}.{namespace + 1}-"), planted("")}
    remove_stale(root)
    assert _workdirs(own_root) == kept
    assert gone not in _workdirs(own_root)
    assert remove_workdir(mine)
