"""Limits for the call as a whole: memory and processes (cgroup layer), bytes written (disk layer)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import sandbox_tools as tools
from tests.unprivileged import WORKER_UID, run_unprivileged, user_namespaces_refused
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.sandbox import cgroup, probe, run_isolated
from toolchord.worker.sandbox.workdir import WORKDIR_ROOT_ENV, sandbox_root, wait_for_removals
from toolchord.worker.sandbox.zygote import stop_zygote
from toolchord.worker.tools import ToolSpec


def run(spec: ToolSpec, **arguments: Any) -> HandlerOutcome:
    return run_isolated(spec, spec.args_model(**arguments), tools.make_context(spec.name))


def call_cgroups() -> list[Path]:
    """This process's call cgroups, once the zygote's spares were let go (each holds the cgroup
    it was confined to ahead of its call) and those of ended calls had time to be removed."""
    stop_zygote()
    deadline = time.monotonic() + 10
    while not cgroup.remove_pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if controllers in ("memory", "pids", ""):
            base = Path("/sys/fs/cgroup", controllers or "unified") / path.lstrip("/")
            if base.is_dir():
                found += list(base.glob(f"toolchord-call-{os.getpid()}-*"))
    return found


@pytest.mark.slow
@pytest.mark.skipif("cgroup" not in probe().available(), reason="needs the cgroup layer")
def test_children_together_cannot_exceed_the_memory_limit() -> None:
    # 4 x 400 MB under memory_mb=512: RLIMIT_AS alone allows each child its 400 MB.
    outcome = run(tools.fork_and_allocate, children=4, megabytes=400)
    assert (outcome.status, outcome.error_type) == ("crashed", "MemoryLimitExceeded"), outcome
    assert "512 MiB" in (outcome.error_message or "")
    assert "cgroup" in outcome.sandbox_layers
    # Every process of the call is gone with its cgroup.
    assert call_cgroups() == []
    later = run(tools.add, a=1, b=2)
    assert (later.status, later.content) == ("ok", "3"), later


@pytest.mark.skipif("cgroup" not in probe().available(), reason="needs the cgroup layer")
def test_calls_report_the_cgroup_layer_and_leave_no_cgroup() -> None:
    outcome = run(tools.where_am_i)
    assert outcome.status == "ok" and "cgroup" in outcome.sandbox_layers, outcome
    assert call_cgroups() == []


@pytest.mark.skipif("disk" not in probe().available(), reason="needs the disk layer")
def test_writing_more_than_the_disk_quota_fails_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    # A root of its own, in a directory the per-call uid can pass through.
    parent = Path(tempfile.mkdtemp(prefix="tc-quota-"))
    parent.chmod(0o755)
    monkeypatch.setenv(WORKDIR_ROOT_ENV, str(parent / "sandbox"))
    try:
        check_disk_quota()
    finally:
        shutil.rmtree(parent)


def check_disk_quota() -> None:
    before = os.statvfs(sandbox_root().path)
    outcome = run(tools.fill_workdir, megabytes=64)
    assert (outcome.status, outcome.error_type) == ("error", "OSError"), outcome
    assert "No space left on device" in (outcome.error_message or "")
    assert "disk" in outcome.sandbox_layers
    # Nothing reached the host's disk, and nothing is left behind.
    after = os.statvfs(sandbox_root().path)
    assert (before.f_bfree - after.f_bfree) * after.f_frsize < 32 * 1024 * 1024
    stop_zygote()  # its spares hold the workdirs they were confined to ahead of their calls
    wait_for_removals()
    root = Path(sandbox_root().path)
    assert stat.S_IMODE(root.stat().st_mode) == 0o711
    assert not list(root.glob("toolchord-call-*"))


@pytest.mark.skipif("disk" not in probe().available(), reason="needs the disk layer")
def test_worker_secret_files_are_hidden_even_with_an_open_filesystem(
    readable_secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Named by a *_FILE setting as the deployments do: DAC alone would let the call's uid read it.
    monkeypatch.setenv("TOOLCHORD_BROKER_URL_FILE", readable_secret)
    outcome = run(tools.read_file_open, path=readable_secret)
    assert (outcome.status, outcome.error_type) == ("error", "FileNotFoundError"), outcome
    assert "hunter2" not in (outcome.content or "") + outcome.output
    assert Path(readable_secret).read_text().endswith("@redis:6379/0")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set up the unprivileged worker")
def test_unprivileged_worker_calls_have_the_disk_quota_and_no_view_of_its_secrets(readable_secret: str) -> None:
    """A worker without privileges (here one that dropped them, so not dumpable) gives its calls
    the same mount namespace as a root worker, through a user namespace of their own."""
    if user_namespaces_refused():
        pytest.skip("this kernel refuses an ordinary user a user namespace")
    filled = run_unprivileged("fill_workdir", megabytes=64)
    assert (filled.status, filled.error_type) == ("error", "OSError"), filled
    assert "No space left on device" in (filled.error_message or "") and "disk" in filled.sandbox_layers
    outcome = run_unprivileged("read_file_open", env={"TOOLCHORD_BROKER_URL_FILE": readable_secret},
                               path=readable_secret)
    assert (outcome.status, outcome.error_type) == ("error", "FileNotFoundError"), outcome


@pytest.fixture
def delegated_cgroup() -> Iterator[tuple[str, ...]]:
    """v1 memory and pids cgroups owned by the unprivileged worker's uid, as a delegation gives."""
    try:
        found = cgroup.find_hierarchies()
    except OSError as exc:
        pytest.skip(f"no writable cgroup hierarchy: {exc}")
    if found[0].version != 1:
        pytest.skip("delegation is set up here for cgroup v1 only")
    directories = tuple(os.path.join(h.path, f"tc-delegated-{os.getpid()}") for h in found)
    for directory in directories:
        os.mkdir(directory)
        for path in (directory, os.path.join(directory, "tasks"), os.path.join(directory, "cgroup.procs")):
            os.chown(path, WORKER_UID, WORKER_UID)
    yield directories
    # The worker process ended with os._exit: kill and remove what its last call left.
    for hierarchy, directory in zip(found, directories, strict=True):
        for child in Path(directory).iterdir():
            if child.is_dir():
                left = cgroup.CallCgroup(((hierarchy, str(child)),))
                deadline = time.monotonic() + 10
                while not (left.kill_all() or left.remove()) and time.monotonic() < deadline:  # type: ignore[func-returns-value]
                    time.sleep(0.05)
        os.rmdir(directory)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set up the unprivileged worker")
def test_unprivileged_worker_in_a_delegated_cgroup_bounds_the_call(delegated_cgroup: tuple[str, ...]) -> None:
    outcome = run_unprivileged("fork_and_allocate", cgroups=delegated_cgroup, children=4, megabytes=400)
    assert (outcome.status, outcome.error_type) == ("crashed", "MemoryLimitExceeded"), outcome
    assert "cgroup" in outcome.sandbox_layers and "uid" not in outcome.sandbox_layers


@pytest.mark.skipif("cgroup" not in probe().available(), reason="needs the cgroup layer")
def test_a_grandchild_that_left_the_process_group_dies_with_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from toolchord.worker.sandbox import capabilities

    # Without seccomp a handler's subprocess can setsid() out of the group the call's end kills.
    real = probe()
    monkeypatch.setattr(capabilities, "_cached", real.model_copy(
        update={"seccomp": real.seccomp.model_copy(update={"available": False})}))
    outcome = run(tools.escape_and_sleep)
    assert outcome.status == "ok" and "cgroup" in outcome.sandbox_layers, outcome
    pid = int(outcome.content or "0")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat_file:
                if stat_file.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # killed, waiting for its new parent to reap it
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or before the read
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail(f"the escaped grandchild {pid} outlived its call")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set up the unprivileged worker")
def test_without_a_cgroup_a_call_cannot_hold_memory_in_a_memfd() -> None:
    """memfd pages are not address space: without a cgroup, RLIMIT_AS would not bound them and
    RLIMIT_FSIZE bounds each file, not their number, so memfd_create is refused (EPERM)."""
    outcome = run_unprivileged("hold_in_memfd", without=("cgroup",), megabytes=8)
    assert (outcome.status, outcome.error_type) == ("error", "PermissionError"), outcome
    assert "Operation not permitted" in (outcome.error_message or "")
    assert "cgroup" not in outcome.sandbox_layers and "seccomp" in outcome.sandbox_layers


@pytest.mark.skipif("cgroup" not in probe().available(), reason="needs the cgroup layer")
def test_with_a_cgroup_memfd_pages_count_against_the_call() -> None:
    allowed = run(tools.hold_in_memfd, megabytes=8)
    assert (allowed.status, allowed.data) == ("ok", 8 * 1024 * 1024), allowed
    too_much = run(
        tools.hold_in_memfd.model_copy(
            update={"sandbox": tools.hold_in_memfd.sandbox.model_copy(update={"memory_mb": 64})}
        ),
        megabytes=200,
    )
    # Past max_file_size_mb (64) the write fails with EFBIG; the cgroup (64 MiB) may kill it first.
    assert too_much.status in ("error", "crashed"), too_much
    assert too_much.error_type in ("OSError", "MemoryLimitExceeded"), too_much


def test_secret_paths_named_by_several_settings_are_hidden_once_each(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from toolchord.worker.sandbox.disk import SECRET_DIRECTORIES, secret_directories

    bundle, keys = tmp_path / "bundle", tmp_path / "keys"
    for directory in (bundle, keys):
        directory.mkdir()
        (directory / "secret").write_text("s")
    for name in [name for name in os.environ if name.endswith("_FILE")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    # Two settings name one file, a third another directory's; a relative one is no path to hide.
    monkeypatch.setenv("A_CA_FILE", str(bundle / "secret"))
    monkeypatch.setenv("B_CA_FILE", str(bundle / "secret"))
    monkeypatch.setenv("C_KEY_FILE", str(keys / "secret"))
    monkeypatch.setenv("D_RELATIVE_FILE", "secret")
    host = {os.path.realpath(path) for path in SECRET_DIRECTORIES}
    hidden = [path for path in secret_directories(str(tmp_path / "workdir")) if path not in host]
    assert hidden == [os.path.realpath(bundle), os.path.realpath(keys)]
    # A setting whose directory holds the workdir has its file covered instead, once.
    monkeypatch.setenv("E_KEY_FILE", str(keys / "secret"))
    hidden = [path for path in secret_directories(str(keys / "workdir")) if path not in host]
    assert hidden == [os.path.realpath(bundle), os.path.realpath(keys / "secret")]
