"""Provider adapters: read model output into ToolCalls, render ToolResults back.

One adapter per provider API ("chat", "anthropic", "responses"); see docs/providers.md. Tool
declarations are rendered here too: the registry (worker side) holds the tools and their
provider-neutral declarations, the adapters know the formats.
"""

from __future__ import annotations

from typing import Any

from toolchord.orchestrator.providers.anthropic_messages import AnthropicMessagesAdapter, AnthropicStreamAccumulator
from toolchord.orchestrator.providers.chat_completions import ChatCompletionsAdapter, ChatStreamAccumulator
from toolchord.orchestrator.providers.plain_data import parse_arguments
from toolchord.orchestrator.providers.protocol import (
    AssistantText,
    PairingError,
    ProviderAdapter,
    ProviderFormatError,
    ProviderName,
    StreamAccumulator,
)
from toolchord.orchestrator.providers.responses_api import ResponsesAdapter, ResponsesStreamAccumulator
from toolchord.worker.registry import Registry, tool_declaration
from toolchord.worker.tools import ToolSpec

_ADAPTERS: dict[str, ProviderAdapter] = {
    "chat": ChatCompletionsAdapter(),
    "anthropic": AnthropicMessagesAdapter(),
    "responses": ResponsesAdapter(),
}


def get_adapter(provider: ProviderName) -> ProviderAdapter:
    """The adapter for a provider API name; ValueError for an unknown name (never another's adapter)."""
    try:
        return _ADAPTERS[provider]
    except KeyError:
        raise ValueError(f"unknown provider {provider!r}; expected one of {sorted(_ADAPTERS)}") from None


def declaration(spec: ToolSpec, provider: ProviderName) -> dict[str, Any]:
    """One tool's declaration for a provider's request; ValueError for an unknown provider."""
    return get_adapter(provider).render_tool(tool_declaration(spec))


def declarations(registry: Registry, provider: ProviderName) -> list[dict[str, Any]]:
    """Every tool of a registry declared in the provider's request format, in registration order."""
    return [declaration(spec, provider) for spec in registry]


__all__ = [
    "AnthropicMessagesAdapter",
    "AssistantText",
    "PairingError",
    "AnthropicStreamAccumulator",
    "ChatCompletionsAdapter",
    "ChatStreamAccumulator",
    "ProviderAdapter",
    "ProviderFormatError",
    "ProviderName",
    "ResponsesAdapter",
    "ResponsesStreamAccumulator",
    "StreamAccumulator",
    "declaration",
    "declarations",
    "get_adapter",
    "parse_arguments",
]
