"""TOOLCHORD_SANDBOX_UID: one configured uid for sandboxed calls of a root worker, else one per call."""

from __future__ import annotations

import os
import time

import pytest

from tests import sandbox_tools
from toolchord.worker import ToolContext
from toolchord.worker.config import Settings
from toolchord.worker.runner import run_handler

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the uid-drop layer needs a root worker")


def context() -> ToolContext:
    return ToolContext(call_id="c", session_id="s", tool_name="where_am_i", idempotency_key="k",
                       deadline=time.time() + 10)


def test_configured_uid_is_used() -> None:
    uid = Settings.from_env({"TOOLCHORD_SANDBOX_UID": "45678"}).sandbox_uid
    outcome = run_handler(sandbox_tools.where_am_i, {}, context(), sandbox_uid=uid)
    assert outcome.status == "ok", outcome.error_message
    assert outcome.data["uid"] == 45678


def test_default_is_a_uid_per_call() -> None:
    assert Settings.from_env({}).sandbox_uid is None
    first = run_handler(sandbox_tools.where_am_i, {}, context())
    second = run_handler(sandbox_tools.where_am_i, {}, context())
    assert first.status == second.status == "ok", (first.error_message, second.error_message)
    assert first.data["uid"] != 0 and first.data["uid"] != second.data["uid"]
