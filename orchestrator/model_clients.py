"""Calling the model with the official SDKs: `openai` (Chat Completions, Responses) and `anthropic`.

Each client takes a request rebuilt from the log (a plain dict) and returns the model's output as
plain JSON, streamed or not. Streams are assembled with the provider adapter's stream accumulator,
which hands out each tool call as soon as it is complete. Rate limits and 5xx are retried by the
SDK itself (`max_retries`); a request that still fails raises `ModelError` — a model failure, never
a tool failure.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, Field

from toolchord.orchestrator.providers import get_adapter
from toolchord.orchestrator.providers.plain_data import to_plain
from toolchord.worker.models import ToolCall
from toolchord.worker.registry import Provider

# Local OpenAI-compatible servers ignore the key, but the SDKs refuse to start without one.
PLACEHOLDER_API_KEY = "not-needed"


class _Sdk(NamedTuple):
    """How one provider API is called with its official SDK."""

    module: str
    client: str
    async_client: str
    create: tuple[str, ...]
    key_env: str


_SDKS: dict[Provider, _Sdk] = {
    "chat": _Sdk("openai", "OpenAI", "AsyncOpenAI", ("chat", "completions", "create"), "OPENAI_API_KEY"),
    "responses": _Sdk("openai", "OpenAI", "AsyncOpenAI", ("responses", "create"), "OPENAI_API_KEY"),
    "anthropic": _Sdk("anthropic", "Anthropic", "AsyncAnthropic", ("messages", "create"), "ANTHROPIC_API_KEY"),
}


def _sdk(provider: Provider) -> _Sdk:
    try:
        return _SDKS[provider]
    except KeyError:
        raise ValueError(f"unknown provider {provider!r}; expected one of {sorted(_SDKS)}") from None


class ModelError(RuntimeError):
    """The model could not be called (after the SDK's own retries). Not a tool failure."""

    def __init__(self, provider: Provider, model: str, cause: BaseException) -> None:
        status = getattr(cause, "status_code", None)
        where = f" (HTTP {status})" if status else ""
        super().__init__(f"{provider} model {model!r} failed{where}: {type(cause).__name__}: {cause}")
        self.provider = provider
        self.model = model
        self.status_code: int | None = status


class ModelReply(BaseModel):
    """One model answer: the output as plain JSON, and its calls when they were assembled from a stream."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    output: Any
    streamed: bool = False
    calls: list[ToolCall] | None = Field(default=None, description="Set for streams: calls in completion order.")
    ended_cleanly: bool = Field(
        default=True, description="False for a stream the model did not finish (token limit, refusal, dropped connection).")


class ModelClient(Protocol):
    """Sends one request to one provider API."""

    provider: Provider

    def complete(self, request: dict[str, Any], *, stream: bool = False,
                 on_call: Callable[[ToolCall], object] | None = None) -> ModelReply: ...

    async def acomplete(self, request: dict[str, Any], *, stream: bool = False,
                        on_call: Callable[[ToolCall], object] | None = None) -> ModelReply: ...


class SdkModelClient:
    """A ModelClient on the official SDK for `provider`, with any compatible `base_url`."""

    def __init__(self, provider: Provider, *, base_url: str | None = None, api_key: str | None = None,
                 max_retries: int = 2, timeout: float = 120.0) -> None:
        _sdk(provider)  # an unknown provider fails here, not at the first request
        self.provider = provider
        self._options: dict[str, Any] = {"base_url": base_url, "max_retries": max_retries, "timeout": timeout}
        if api_key is not None:
            self._options["api_key"] = api_key
        elif base_url is not None and not _key_in_env(provider):
            self._options["api_key"] = PLACEHOLDER_API_KEY
        self._sync: Any = None
        self._async: Any = None

    def _client(self, asynchronous: bool) -> Any:
        sdk = _sdk(self.provider)
        factory = getattr(importlib.import_module(sdk.module), sdk.async_client if asynchronous else sdk.client)
        if asynchronous:
            self._async = self._async or factory(**self._options)
            return self._async
        self._sync = self._sync or factory(**self._options)
        return self._sync

    def _create(self, client: Any) -> Any:
        for name in _sdk(self.provider).create:
            client = getattr(client, name)
        return client

    def _errors(self) -> tuple[type[BaseException], ...]:
        # Any SDK's error may surface (an OpenAI-compatible proxy in front of another API, say).
        return tuple(importlib.import_module(module).APIError for module in sorted({s.module for s in _SDKS.values()}))

    def complete(self, request: dict[str, Any], *, stream: bool = False,
                 on_call: Callable[[ToolCall], object] | None = None) -> ModelReply:
        """Send the request and wait for the whole answer (assembling the stream when `stream`;
        `on_call` hears each call the moment the stream completes it)."""
        create = self._create(self._client(False))
        try:
            if not stream:
                return ModelReply(output=to_plain(create(**request)))
            events = create(**request, stream=True)
            try:
                return self._assemble(events, on_call)
            finally:
                events.close()
        except self._errors() as exc:
            raise ModelError(self.provider, str(request.get("model")), exc) from exc

    async def acomplete(self, request: dict[str, Any], *, stream: bool = False,
                        on_call: Callable[[ToolCall], object] | None = None) -> ModelReply:
        """Async twin of `complete`."""
        create = self._create(self._client(True))
        try:
            if not stream:
                return ModelReply(output=to_plain(await create(**request)))
            events = await create(**request, stream=True)
            try:
                return await self._aassemble(events, on_call)
            finally:
                await events.close()
        except self._errors() as exc:
            raise ModelError(self.provider, str(request.get("model")), exc) from exc

    def _assemble(self, events: Iterable[Any], on_call: Callable[[ToolCall], object] | None) -> ModelReply:
        assembly = _Assembly(self.provider, on_call)
        for event in events:
            assembly.feed(event)
        return assembly.reply()

    async def _aassemble(self, events: AsyncIterator[Any], on_call: Callable[[ToolCall], object] | None) -> ModelReply:
        assembly = _Assembly(self.provider, on_call)
        async for event in events:
            assembly.feed(event)
        return assembly.reply()

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.close()
            self._async = None


class _Assembly:
    """One stream being assembled: each completed call goes to `on_call` at once; a call the
    stream amends later (a chat proxy interleaving fragments) keeps its last form."""

    def __init__(self, provider: Provider, on_call: Callable[[ToolCall], object] | None) -> None:
        self._accumulator = get_adapter(provider).stream_accumulator()
        self._on_call = on_call
        self._calls: dict[str, ToolCall] = {}

    def _take(self, calls: list[ToolCall]) -> None:
        for call in calls:
            amended = call.id in self._calls
            self._calls[call.id] = call
            if self._on_call is not None and not amended:
                self._on_call(call)

    def feed(self, event: Any) -> None:
        self._take(self._accumulator.feed(event))

    def reply(self) -> ModelReply:
        self._take(self._accumulator.finish())
        return ModelReply(output=self._accumulator.assistant_output(), streamed=True, calls=list(self._calls.values()),
                          ended_cleanly=self._accumulator.ended_cleanly())


def _key_in_env(provider: Provider) -> bool:
    return bool(os.environ.get(_sdk(provider).key_env))


def make_model_client(provider: Provider, *, base_url: str | None = None, api_key: str | None = None,
                      max_retries: int = 2, timeout: float = 120.0) -> SdkModelClient:
    """A client for `provider` ("chat" | "responses" | "anthropic"); retries are the SDK's `max_retries`."""
    return SdkModelClient(provider, base_url=base_url, api_key=api_key, max_retries=max_retries, timeout=timeout)


__all__ = ["PLACEHOLDER_API_KEY", "ModelClient", "ModelError", "ModelReply", "SdkModelClient", "make_model_client"]
