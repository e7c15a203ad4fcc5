"""A real stdio MCP server for the MCP tests, written with the `mcp` package's MCPServer (FastMCP).

Run as `python -m tests.mcp_server` (cwd: the project root). Side effects are counted in the Redis
named by TC_TEST_LEDGER, under the same keys as tests/celery_tools.py.
"""

from __future__ import annotations

import os
import sys
import time

import redis
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

server = MCPServer("toolchord-test")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def lookup(item: str) -> str:
    """Look an item up."""
    return f"found {item}"


@server.tool(annotations=ToolAnnotations(idempotent_hint=True, destructive_hint=False))
def put_value(key: str, value: int) -> str:
    """Store a value under a key."""
    return f"{key}={value}"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def sleepy(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def effect(key: str, seconds: float = 0.0) -> int:
    """Count a side effect, then take a while (no annotations: unsafe)."""
    count = int(redis.Redis.from_url(os.environ["TC_TEST_LEDGER"]).incr(f"tc-test:effects:{key}"))
    time.sleep(seconds)
    return count


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
def fail(reason: str) -> str:
    """Always fails."""
    raise ToolError(reason)


@server.tool()
def crash() -> str:
    """The server process dies mid-call (no annotations: unsafe)."""
    os._exit(3)


if __name__ == "__main__":
    # With a port argument: streamable HTTP on the loopback interface, else stdio.
    if len(sys.argv) > 1:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run("stdio")
