"""The tools of tests/mcp_server.py as a toolchord tools module (for `toolchord worker --tools`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from toolchord.orchestrator.integrations.mcp import McpServer, mcp_registry

SERVER = McpServer.stdio(
    sys.executable, ["-m", "tests.mcp_server"], name="test-server", cwd=str(Path(__file__).resolve().parent.parent),
    # The server counts side effects in the tests' Redis; workers get its URL in their environment.
    env={"TC_TEST_LEDGER": os.environ.get("TC_TEST_LEDGER", "")},
)

registry = mcp_registry(SERVER, overrides={"sleepy": {"timeout": 1.0, "max_retries": 0}})
