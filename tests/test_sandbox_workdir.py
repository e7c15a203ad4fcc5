"""Per-call workdirs: a private sandbox root, and a removal that never reaches above the workdir.

Each test gets a stand-in for the host's temporary directory (world-writable and sticky, like
/tmp) so that a regression damages only that, never the machine's /tmp.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import sandbox_tools as tools
from tests.unprivileged import WORKER_UID, run_unprivileged, user_namespaces_refused
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.sandbox import run_isolated
from toolchord.worker.sandbox.workdir import WORKDIR_ROOT_ENV, SandboxRootError, sandbox_root, wait_for_removals
from toolchord.worker.sandbox.zygote import stop_zygote
from toolchord.worker.tools import ToolSpec

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play both worker kinds")


def run(spec: ToolSpec, **arguments: Any) -> HandlerOutcome:
    return run_isolated(spec, spec.args_model(**arguments), tools.make_context(spec.name))


@pytest.fixture
def host_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fake host /tmp (mode 1777), reachable by any uid, used as the system temporary directory."""
    # An earlier test's zygote confines its next spares in the background: let them go first, or
    # one would make its workdir under this test's fake /tmp.
    without_spares()
    path = Path(tempfile.mkdtemp(prefix="tc-host-tmp-"))
    path.chmod(0o1777)
    monkeypatch.delenv(WORKDIR_ROOT_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def outside(host_tmp: Path) -> Path:
    """A directory outside every workdir, with a file in it."""
    directory = host_tmp / "outside"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    (directory / "keep.txt").write_text("keep")
    return directory


def without_spares() -> None:
    """Let the zygote's spares go (each holds the workdir it was confined to ahead of its call),
    and wait until what the calls and spares left is removed."""
    stop_zygote()
    wait_for_removals()


def assert_untouched(host_tmp: Path, outside: Path) -> None:
    without_spares()
    assert stat.S_IMODE(host_tmp.stat().st_mode) == 0o1777
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert (outside / "keep.txt").read_text() == "keep"


def test_default_root_is_a_private_directory_not_the_temporary_directory(host_tmp: Path) -> None:
    outcome = run(tools.where_am_i)
    assert outcome.status == "ok", outcome
    root = Path(outcome.data["workdir"]).parent
    assert root.parent == host_tmp and root != host_tmp
    info = root.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
    assert stat.S_IMODE(info.st_mode) == 0o711


def test_a_root_planted_by_someone_else_is_refused(host_tmp: Path, outside: Path) -> None:
    # Someone else's symlink where the default root would be: it must not be used or followed.
    (host_tmp / f"toolchord-sandbox-{os.geteuid()}").symlink_to(outside)
    with pytest.raises(SandboxRootError):
        sandbox_root()
    outcome = run(tools.add, a=1, b=2)
    assert (outcome.status, outcome.error_type, outcome.started) == ("error", "SandboxError", False)
    assert_untouched(host_tmp, outside)


def test_handler_replacing_its_workdir_leaves_the_root_alone(host_tmp: Path, outside: Path) -> None:
    replaced = run(tools.replace_own_workdir)
    swapped = run(tools.swap_workdir_for_symlink, target=str(outside))
    for outcome in (replaced, swapped):
        assert outcome.status in ("ok", "error"), outcome
    assert_untouched(host_tmp, outside)
    assert not [p for p in host_tmp.rglob("toolchord-call-*")]
    later = run(tools.where_am_i)
    assert later.status == "ok", later


@ROOT_ONLY
def test_unprivileged_worker_whose_handler_swaps_its_workdir(host_tmp: Path, outside: Path) -> None:
    # Without the disk layer (a kernel that refuses user namespaces) the workdir is a plain
    # directory of the worker's own uid, not a mount point the handler cannot remove.
    replaced = run_unprivileged("replace_own_workdir", without=("disk",))
    swapped = run_unprivileged("swap_workdir_for_symlink", without=("disk",), target=str(outside))
    # The handler runs as the worker's own uid: it may replace its workdir, never more.
    assert (replaced.status, replaced.content) == ("ok", "replaced"), replaced
    assert (swapped.status, swapped.content) == ("ok", "swapped"), swapped
    assert_untouched(host_tmp, outside)
    root = host_tmp / f"toolchord-sandbox-{WORKER_UID}"
    assert stat.S_IMODE(root.stat().st_mode) == 0o711 and list(root.iterdir()) == []
    later = run_unprivileged("where_am_i")
    assert later.status == "ok", later


@ROOT_ONLY
def test_unprivileged_worker_removes_a_workdir_its_handler_moved_away(host_tmp: Path) -> None:
    moved = host_tmp / "moved-workdir"
    outcome = run_unprivileged("rename_own_workdir", without=("disk",), to=str(moved))
    assert (outcome.status, outcome.content) == ("ok", "renamed"), outcome
    wait_for_removals()
    assert not moved.exists()
    assert list((host_tmp / f"toolchord-sandbox-{WORKER_UID}").iterdir()) == []


@ROOT_ONLY
def test_unprivileged_worker_with_the_disk_layer_keeps_its_workdir(host_tmp: Path, outside: Path) -> None:
    if user_namespaces_refused():
        pytest.skip("this kernel refuses an ordinary user a user namespace")
    for outcome in (run_unprivileged("replace_own_workdir"),
                    run_unprivileged("swap_workdir_for_symlink", target=str(outside))):
        # The workdir is the mount point of the call's tmpfs: it cannot be removed or replaced.
        assert (outcome.status, outcome.error_type) == ("error", "OSError"), outcome
        assert "Device or resource busy" in (outcome.error_message or ""), outcome
    assert_untouched(host_tmp, outside)
    assert list((host_tmp / f"toolchord-sandbox-{WORKER_UID}").iterdir()) == []


@ROOT_ONLY
def test_unprivileged_worker_removes_directories_left_without_permissions(host_tmp: Path) -> None:
    outcome = run_unprivileged("leave_unreadable_directory")
    assert (outcome.status, outcome.content) == ("ok", "left"), outcome
    root = host_tmp / f"toolchord-sandbox-{WORKER_UID}"
    assert list(root.iterdir()) == []


def test_root_worker_removes_directories_left_without_permissions(host_tmp: Path) -> None:
    outcome = run(tools.leave_unreadable_directory)
    assert (outcome.status, outcome.content) == ("ok", "left"), outcome
    without_spares()
    assert not [p for p in host_tmp.rglob("toolchord-call-*")]
