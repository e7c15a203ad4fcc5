"""The seams every provider adapter implements, and the one error they raise."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from worker.models import ToolCall, ToolResult
from worker.registry import Provider

ProviderName = Provider
"""The provider API an adapter speaks: "chat", "anthropic" or "responses" (same as worker.Provider)."""


class ProviderFormatError(ValueError):
    """Protocol corruption: assistant output that cannot be read at all.

    Raised for a tool call without id or name, two calls sharing an id, a content list that is not
    a list, a stream fragment for a call that never started, and the like. The turn ends here.
    A call whose *arguments* are not valid JSON is not corruption: it is returned with
    `arguments=None` and the pipeline answers it with an INVALID_JSON result.
    """


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


@runtime_checkable
class ProviderAdapter(Protocol):
    """Reads a provider's assistant output into ToolCalls and renders ToolResults back."""

    name: ProviderName

    def parse_calls(self, output: Any) -> list[ToolCall]:
        """The tool calls of one assistant output, in the model's order."""
        ...

    def assistant_items(self, output: Any) -> list[dict[str, Any]]:
        """The assistant turn as request messages/items: JSON-safe dicts, content kept verbatim."""
        ...

    def result_items(self, results: list[ToolResult]) -> list[dict[str, Any]]:
        """The results as request messages/items, in the given order."""
        ...

    def stream_accumulator(self) -> StreamAccumulator:
        """A fresh accumulator for one streamed assistant turn."""
        ...
