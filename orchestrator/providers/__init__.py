"""Provider adapters: read model output into ToolCalls, render ToolResults back.

One adapter per provider API ("chat", "anthropic", "responses"); see docs/providers.md.
"""

from __future__ import annotations

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
    "get_adapter",
    "parse_arguments",
]
