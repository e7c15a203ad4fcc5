"""Optional integrations with agent frameworks and MCP; each module needs its extra."""
