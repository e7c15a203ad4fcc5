"""The seams every provider adapter implements, and the errors they raise.

The adapter is the only place that knows a provider's format: reading output into calls, the
assistant turn and the results as request items, tool declarations, where the system prompt goes,
how stored items are made request-safe, and where results must sit relative to their calls.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import Provider, ToolDeclaration

ProviderName = Provider
"""The provider API an adapter speaks: "chat", "anthropic" or "responses" (same as worker.Provider)."""


class ProviderFormatError(ValueError):
    """Protocol corruption: assistant output that cannot be read at all.

    Raised for a tool call without id or name, two calls sharing an id, a content list that is not
    a list, a stream fragment for a call that never started, and the like. The turn ends here.
    A call whose *arguments* are not valid JSON is not corruption: it is returned with
    `arguments=None` and the pipeline answers it with an INVALID_JSON result.
    """


class PairingError(RuntimeError):
    """A rendered request breaks call/result pairing: a broken invariant, never sent to a provider."""


class AssistantText(NamedTuple):
    """The text parts of a stored assistant turn, and how many reasoning parts it had."""

    texts: list[str]
    reasoning: int


@runtime_checkable
class StreamAccumulator(Protocol):
    """Assembles one streamed assistant turn and hands out each tool call once it is complete."""

    def feed(self, event: Any) -> list[ToolCall]:
        """Take one stream event (SDK object or dict); return the calls this event completed."""
        ...

    def finish(self) -> list[ToolCall]:
        """The stream ended: return every call not yet handed out, in index order."""
        ...

    def assistant_output(self) -> dict[str, Any]:
        """The assembled assistant output (text and calls), in the shape `parse_calls` accepts."""
        ...

    def ended_cleanly(self) -> bool:
        """Whether the model ended the message itself: not cut by a token limit, a refusal or a
        dropped connection (eager dispatch starts `unsafe` calls only after a clean end)."""
        ...


@runtime_checkable
class ProviderAdapter(Protocol):
    """Everything toolchord needs to know about one provider API's format."""

    name: ProviderName

    def parse_calls(self, output: Any) -> list[ToolCall]:
        """The tool calls of one assistant output, in the model's order."""
        ...

    def assistant_items(self, output: Any) -> list[dict[str, Any]]:
        """The assistant turn as request messages/items: JSON-safe dicts, extension fields kept,
        response-only fields dropped, arguments that are not a JSON object replaced by `{}`."""
        ...

    def result_items(self, results: list[ToolResult]) -> list[dict[str, Any]]:
        """The results as request messages/items, in the given order."""
        ...

    def stream_accumulator(self) -> StreamAccumulator:
        """A fresh accumulator for one streamed assistant turn."""
        ...

    def render_tool(self, declaration: ToolDeclaration) -> dict[str, Any]:
        """One provider-neutral tool declaration in this provider's request format."""
        ...

    def clean_items(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Stored assistant items (this provider's) made request-safe, as `assistant_items` makes them."""
        ...

    def calls_in_items(self, items: list[dict[str, Any]]) -> list[ToolCall]:
        """The calls of an assistant turn stored as this provider's request items, in order."""
        ...

    def assistant_text(self, items: list[dict[str, Any]]) -> AssistantText:
        """The text of a stored assistant turn (reasoning left out, but counted)."""
        ...

    def assistant_turn(self, texts: list[str], calls: list[ToolCall]) -> list[dict[str, Any]]:
        """An assistant turn written for another provider, as this provider's request items."""
        ...

    def append_message(self, messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
        """Append a message to a request's conversation (merging where the provider requires it)."""
        ...

    def place_conversation(self, request: dict[str, Any], system: str | None, messages: list[dict[str, Any]],
                           max_tokens: int) -> None:
        """Put the system prompt and the conversation where this provider's request takes them."""
        ...

    def check_pairing(self, request: dict[str, Any]) -> None:
        """Raise PairingError unless every call has exactly one result, placed as the provider wants."""
        ...
