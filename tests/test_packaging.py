"""What `pip install toolchord` puts on a user's machine: one import name, and nothing it can shadow.

The wheel is built from a copy of the tracked files (the source tree is left untouched while other
test processes use it) and installed with `--target`, so the checks run against the installed copy,
not the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked_copy(destination: Path) -> None:
    """The repository's tracked files, symbolic links kept as links (what a fresh clone holds)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source, target = ROOT / name, destination / name
        if not source.is_symlink() and not source.exists():
            continue  # deleted in the working tree, not yet committed
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        else:
            shutil.copy2(source, target)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    _tracked_copy(source)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True,
    )
    (built,) = out.glob("toolchord-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True,
    )
    yield target


@pytest.mark.timeout(300)
def test_the_wheel_installs_one_import_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top_level = {name.split("/", 1)[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"toolchord"}
    # The linked folders arrive as real packages, with their data files.
    for expected in ("toolchord/__init__.py", "toolchord/testing.py", "toolchord/py.typed",
                     "toolchord/worker/tasks.py", "toolchord/worker/sandbox/zygote_server.py",
                     "toolchord/orchestrator/runtime.py", "toolchord/orchestrator/ui/static/index.html",
                     "toolchord/orchestrator/bench/turns.py"):  # `toolchord bench` works when installed
        assert expected in names
    (info,) = {t for t in top_level if t.endswith(".dist-info")}
    top_level_txt = zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").decode().split()
    assert top_level_txt == ["toolchord"]


# A user's Celery project with the two most common module names of its own.
USER_WORKER = '''
"""The user's own worker module (Celery tutorials call it worker.py)."""
MARK = "user worker"
'''
USER_ORCHESTRATOR = '''
"""The user's own orchestrator module."""
MARK = "user orchestrator"
'''
USER_MAIN = '''
import json
import sys

import orchestrator
import worker
from toolchord import Orchestrator, Registry, ToolContext, tool
from toolchord.testing import ScriptedModelServer


@tool(side_effect="read", sandbox={"isolate": False})
def get_order(order_id: str, ctx: ToolContext) -> dict:
    """Look up an order."""
    return {"order_id": order_id, "session": ctx.session_id}


orch = Orchestrator(Registry([get_order]))
turn = orch.run_turn("s-1", {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": "A-1"}'}},
]}, provider="chat")
orch.close()
import toolchord.worker.tasks
print(json.dumps({
    "user": [worker.MARK, orchestrator.MARK],
    "messages": turn.to_messages(),
    "toolchord": toolchord.__file__,
    "scripted": ScriptedModelServer.__module__,
    "foreign": sorted(m for m in sys.modules if m.split(".")[0] in ("worker", "orchestrator")
                      and getattr(sys.modules[m], "__file__", "").find("toolchord") >= 0),
}))
'''


@pytest.mark.timeout(300)
def test_a_project_with_its_own_worker_and_orchestrator_modules_runs_a_turn(installed: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "worker.py").write_text(USER_WORKER)
    (project / "orchestrator.py").write_text(USER_ORCHESTRATOR)
    (project / "main.py").write_text(textwrap.dedent(USER_MAIN))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    # The installed wheel first, then this interpreter's dependencies; never the repository.
    env["PYTHONPATH"] = str(installed)
    done = subprocess.run([sys.executable, "main.py"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    import json

    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["user"] == ["user worker", "user orchestrator"]
    assert report["toolchord"].startswith(str(installed))
    assert report["scripted"].startswith("toolchord.")
    assert report["foreign"] == []
    (message,) = report["messages"]
    assert message["role"] == "tool" and message["tool_call_id"] == "call_1"
    assert '"A-1"' in message["content"] and '"s-1"' in message["content"]


def test_the_face_exports_what_docs_api_lists() -> None:
    import toolchord

    api = (ROOT / "docs" / "api.md").read_text()
    for name in toolchord.__all__:
        assert f"`{name}" in api, f"docs/api.md does not list toolchord.{name}"
    for name in ("tool", "Registry", "ToolContext", "SandboxProfile", "Orchestrator", "Agent", "create_app"):
        assert name in toolchord.__all__
        assert getattr(toolchord, name) is not None
    with pytest.raises(AttributeError):
        toolchord.__getattr__("ScriptedModelServer")


def test_celery_finds_the_app_by_the_package_name() -> None:
    code = "from celery.app.utils import find_app; print(type(find_app('toolchord')).__name__)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}  # embedded
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ToolchordCelery"
