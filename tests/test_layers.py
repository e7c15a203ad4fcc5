"""The import rules of the code base: one import name, layers that point one way, no circles.

Read from the source with `ast`: every import counts, at module level or inside a function (a
function-level import is still an arrow), except those under `if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "toolchord"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for directory, _, files in os.walk(PACKAGE, followlinks=True):
        for name in files:
            if name.endswith(".py"):
                path = Path(directory) / name
                found[_module_name(path)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str) -> set[str]:
    """Modules this file imports when it runs (absolute names)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for statement in node.orelse:
                visit(statement)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # `from package import submodule` imports the submodule.
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    return {name: {i for i in _imports(path, name) if i in sources and i != name} for name, path in sources.items()}


def test_only_the_toolchord_name_is_imported() -> None:
    """No module imports the folders `worker` or `orchestrator` as top-level packages."""
    offenders = []
    for directory in ("toolchord", "tests", "examples"):
        for folder, _, files in os.walk(ROOT / directory, followlinks=True):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = Path(folder) / name
                for imported in _imports(path, _module_name(path)):
                    if imported.split(".")[0] in ("worker", "orchestrator"):
                        offenders.append(f"{path.relative_to(ROOT)}: {imported}")
    assert offenders == []


def test_the_worker_never_imports_the_orchestrator() -> None:
    graph = _graph()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.startswith("toolchord.worker")
        for target in targets
        if target.startswith("toolchord.orchestrator") or target in ("toolchord", "toolchord.testing")
    )
    assert upward == []


def test_the_import_graph_has_no_circle() -> None:
    graph = _graph()
    # Tarjan's strongly connected components; a component of two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    assert circles == []


def test_a_worker_process_loads_no_orchestrator_code() -> None:
    """What a worker imports at start (tasks, the app, the sandbox) brings no orchestrator module."""
    code = (
        "import sys, toolchord.worker.tasks, toolchord.worker.celery_app, toolchord.worker.sandbox.zygote_server;"
        "print(sorted(m for m in sys.modules if m.startswith('toolchord.orchestrator')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_worker_command_loads_no_orchestrator_code_before_celery() -> None:
    """`toolchord worker` runs in the CLI's package, `toolchord.orchestrator`: up to its exec of
    Celery it holds that package's face and the CLI module, not the orchestrator or a provider SDK."""
    code = (
        "import sys, toolchord.orchestrator.cli, toolchord.worker.launch;"
        "toolchord.worker.launch.worker_command(['--tools', 'tests.celery_tools'], {'TOOLCHORD_BROKER_URL': 'redis://x'});"
        "print(sorted(m for m in sys.modules if m.startswith('toolchord.orchestrator') or m in ('openai', 'anthropic')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['toolchord.orchestrator', 'toolchord.orchestrator.cli']"


def test_the_orchestrator_package_face_loads_each_name_on_first_use() -> None:
    """`from toolchord.orchestrator import Orchestrator` still works, and is the top package's object."""
    import toolchord
    import toolchord.orchestrator as orchestrator
    from toolchord.orchestrator import Orchestrator, TurnResult

    assert Orchestrator is toolchord.Orchestrator and TurnResult is orchestrator.TurnResult
    assert set(orchestrator.__all__) <= set(dir(orchestrator))
    with pytest.raises(AttributeError, match="no attribute 'Worker'"):
        orchestrator.Worker  # noqa: B018


def test_the_approval_desk_does_not_know_the_orchestrator() -> None:
    """approvals.py sends and withdraws calls through the dispatcher, not through `Orchestrator`: not
    even a type-checking import of the runtime (which would hide a circle from the test above)."""
    tree = ast.parse((PACKAGE / "orchestrator" / "approvals.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "toolchord.orchestrator.runtime" not in imported


def test_tools_and_the_zygote_load_no_redis_client() -> None:
    """Tool modules (`tool`, `Limit`) and the sandbox zygote import no redis-py: the zygote runs
    under interpreters that may lack its dependencies, and every module it holds is forked per call."""
    code = (
        "import sys, toolchord.worker.tools, toolchord.worker.limits, toolchord.worker.sandbox.zygote_server;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'redis'))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
