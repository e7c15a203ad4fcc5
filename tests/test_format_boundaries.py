"""The seams that keep provider formats and side-effect classes in one place each.

A provider's format lives in its adapter (orchestrator/providers) and a side-effect class's
meaning in worker/policy.py: everything else asks them. These tests fail when code elsewhere starts
branching on a provider or class name again, or when a name has no adapter or policy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest

from toolchord.orchestrator.events import SessionStarted
from toolchord.orchestrator.history_repair import History
from toolchord.orchestrator.model_clients import make_model_client
from toolchord.orchestrator.providers import ProviderAdapter, declaration, declarations, get_adapter
from toolchord.orchestrator.request_builder import render
from toolchord.worker import Provider, Registry, SideEffect, tool
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import Settings
from toolchord.worker.policy import SIDE_EFFECT_POLICIES
from toolchord.worker.tasks import TASK_NAMES

ROOT = Path(__file__).resolve().parent.parent
PROVIDER_BRANCH = re.compile(r"""provider\w*\s*(==|!=)\s*["']|provider\w*\s+in\s+\(["']""")
CLASS_BRANCH = re.compile(r"""(==|!=)\s*["'](read|idempotent|unsafe)["']""")
# The scripted model server, the demo and the stream bench serve every API on purpose (test, demo and bench tooling).
PROVIDER_BRANCH_ALLOWED = {"orchestrator/scripted_model.py", "orchestrator/demo.py", "orchestrator/bench/stream.py"}


def _sources() -> list[tuple[str, str]]:
    files = sorted([*ROOT.glob("orchestrator/**/*.py"), *ROOT.glob("worker/**/*.py")])
    return [(str(path.relative_to(ROOT)), path.read_text()) for path in files]


def test_only_the_adapters_branch_on_a_provider() -> None:
    offending = [name for name, text in _sources()
                 if PROVIDER_BRANCH.search(text) and not name.startswith("orchestrator/providers/")
                 and name not in PROVIDER_BRANCH_ALLOWED]
    assert offending == []


def test_only_the_policy_table_branches_on_a_side_effect_class() -> None:
    assert [name for name, text in _sources() if CLASS_BRANCH.search(text)] == []


def test_every_provider_has_a_complete_adapter() -> None:
    for provider in get_args(Provider):
        adapter = get_adapter(provider)
        assert isinstance(adapter, ProviderAdapter) and adapter.name == provider


def test_every_side_effect_class_has_a_policy_and_a_task() -> None:
    assert set(SIDE_EFFECT_POLICIES) == set(get_args(SideEffect)) == set(TASK_NAMES)
    app = create_app(Settings())
    assert {policy.task_name for policy in SIDE_EFFECT_POLICIES.values()} <= set(app.tasks)


@tool(side_effect="read", sandbox={"isolate": False})
def noop() -> str:
    """Do nothing."""
    return "ok"


@pytest.mark.parametrize("use", ["adapter", "declaration", "render", "client"])
def test_an_unknown_provider_raises_instead_of_using_another_providers_format(use: str) -> None:
    unknown: Any = "gemini"
    with pytest.raises(ValueError, match="unknown provider 'gemini'"):
        if use == "adapter":
            get_adapter(unknown)
        elif use == "declaration":
            declaration(noop, unknown)
        elif use == "render":
            render(History.from_events([SessionStarted(provider="chat", model="m")]), unknown)
        else:
            make_model_client(unknown)
    assert declarations(Registry([noop]), "anthropic") == [
        {"name": "noop", "description": "Do nothing.", "input_schema": declaration(noop, "anthropic")["input_schema"]}
    ]
