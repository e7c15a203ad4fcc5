"""The operator documentation covers what the code defines: every error code, every tool policy
field, every configuration variable, and the modules the architecture page points to."""

from __future__ import annotations

import re
from pathlib import Path

from toolchord.worker.models import ErrorCode
from toolchord.worker.sandbox.profile import SandboxProfile
from toolchord.worker.tools import ToolSpec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_errors_doc_has_an_example_per_code_in_the_model_facing_layout() -> None:
    text = (DOCS / "errors.md").read_text()
    for code in ErrorCode:
        section = re.search(rf"^## {code.value}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        assert section, f"no section for {code.value}"
        example = re.search(r"```\n(.*?)```", section.group(1), re.S)
        assert example, f"no example for {code.value}"
        lines = example.group(1).splitlines()
        assert lines[0].startswith(f"{code.value}: ")
        assert any(line.startswith("Input: ") for line in lines)
        assert lines[-1].startswith("Fix: ")


def test_tools_doc_lists_every_policy_field() -> None:
    text = (DOCS / "tools.md").read_text()
    for field in [*ToolSpec.model_fields, *SandboxProfile.model_fields]:
        assert f"| `{field}` |" in text, field
    for side_effect in ("read", "idempotent", "unsafe"):
        assert f"| `{side_effect}` |" in text


def test_configuration_doc_covers_the_interface_variables_and_conventions() -> None:
    text = (DOCS / "configuration.md").read_text()
    for variable in (
        "TOOLCHORD_BROKER_URL", "TOOLCHORD_RESULT_BACKEND", "TOOLCHORD_REDIS_URL", "TOOLCHORD_TOOL_MODULES",
        "TOOLCHORD_DEFAULT_QUEUE", "TOOLCHORD_VISIBILITY_TIMEOUT", "TOOLCHORD_RESULT_TTL",
        "TOOLCHORD_SANDBOX_UID", "TOOLCHORD_LOG_DIR", "FLOWER_BASIC_AUTH", "TOOLCHORD_MAX_ARGUMENT_BYTES",
        "TOOLCHORD_MAX_RESULT_DATA_BYTES", "TOOLCHORD_MAX_CALLS_PER_TURN",
    ):
        assert f"| `{variable}` |" in text, variable
    for phrase in ("_FILE", "rediss://", "ssl_cert_reqs", "pickle", "user default off"):
        assert phrase in text, phrase


def test_architecture_doc_points_at_modules_that_exist() -> None:
    text = (DOCS / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:orchestrator|worker)/[\w/]*(?:\.py)?)`", text))
    assert {"orchestrator/pipeline.py", "worker/tasks.py", "worker/sandbox/"} <= paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"architecture.md names modules that do not exist: {missing}"


def test_deployment_doc_says_what_was_validated_and_how() -> None:
    text = (DOCS / "deployment.md").read_text()
    assert "validated statically, not run" in text
    for tool in ("check-jsonschema", "kubectl kustomize", "systemd-analyze verify"):
        assert tool in text
