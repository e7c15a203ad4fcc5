"""A small MCP server (the `mcp` package's MCPServer) that examples/mcp_example.py starts over stdio."""

from __future__ import annotations

import time

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("notes")
NOTES: dict[str, str] = {}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def search_notes(query: str) -> str:
    """Search the notes."""
    return f"2 notes match {query!r}: 'standup', 'retro'"


@server.tool(annotations=ToolAnnotations(idempotent_hint=True, destructive_hint=False))
def save_note(title: str, text: str) -> str:
    """Create or replace a note."""
    NOTES[title] = text
    return f"saved {title!r}"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def export_notes(fmt: str) -> str:
    """Export every note (slow)."""
    time.sleep(5)
    return f"exported as {fmt}"


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
def send_notes(to: str) -> str:
    """Email the notes to someone (not idempotent: never run twice)."""
    return f"sent {len(NOTES)} notes to {to}"


if __name__ == "__main__":
    server.run("stdio")
