"""Provider adapters: read model output into ToolCalls, render ToolResults back.

One adapter per provider API ("chat", "anthropic", "responses"); see docs/providers.md.
"""

from __future__ import annotations

from orchestrator.providers.anthropic_messages import AnthropicMessagesAdapter, AnthropicStreamAccumulator
from orchestrator.providers.chat_completions import ChatCompletionsAdapter, ChatStreamAccumulator
from orchestrator.providers.plain_data import parse_arguments
from orchestrator.providers.protocol import (
    AssistantText,
    PairingError,
    ProviderAdapter,
    ProviderFormatError,
    ProviderName,
    StreamAccumulator,
)
from orchestrator.providers.responses_api import ResponsesAdapter, ResponsesStreamAccumulator

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
