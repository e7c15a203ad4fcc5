"""The test cluster's tools (tests/celery_tools.py) as an orchestrator with approval policies sees them.

Workers load `tests.celery_tools` unchanged: the approval policy is the orchestrator's business.
"""

from __future__ import annotations

from collections.abc import Mapping

from tests.cluster_helpers import TOOLS, settings_for
from toolchord.orchestrator import Orchestrator
from toolchord.orchestrator.event_stores import RedisEventLog
from toolchord.worker import Registry
from toolchord.worker.celery_app import create_app

HELD = {"effect_unsafe": "always", "charge": "always"}


def approval_registry(timeouts: Mapping[str, float] | None = None) -> Registry:
    """The test tools, with `effect_unsafe` and `charge` held for approval (`timeouts`: approval
    timeouts by tool name)."""
    timeouts = timeouts or {}
    base = Registry.from_modules([TOOLS])
    return Registry([
        spec.model_copy(update={"approval": HELD[spec.name],
                                "approval_timeout": timeouts.get(spec.name, spec.approval_timeout)})
        if spec.name in HELD else spec
        for spec in base
    ])


def approval_orchestrator(url: str, timeouts: Mapping[str, float] | None = None) -> Orchestrator:
    """An orchestrator on the test cluster whose decisions go to the session logs in Redis."""
    registry = approval_registry(timeouts)
    return Orchestrator(registry, create_app(settings_for(url), registry), event_log=RedisEventLog(url))
