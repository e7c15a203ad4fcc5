"""MCP client sessions held by a worker process: one live session per configured server.

Sessions live on a private asyncio loop thread, started lazily on the first call in a process and
again after a fork (a prefork pool child gets its own). Before each call the session is pinged;
a session whose server has gone away is replaced before the call is sent, so a restart never
sends a call twice. A server that dies while a call is in flight is reported as lost
(`HandlerLost`): the call may have taken effect, so an unsafe tool gets `OUTCOME_UNKNOWN`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import httpx2
from mcp import types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ConfigDict, Field, model_validator

from toolchord.worker.execution import HandlerLost, HandlerTimeout

T = TypeVar("T")

# A live session answers a ping at once; a dead stdio server fails it at once too.
_PING_SECONDS = 5.0


class McpServer(BaseModel):
    """How to reach one MCP server: a command spoken to over stdio, or a streamable HTTP URL."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="A label for logs and error messages.")
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = Field(
        default=None, description="Extra variables for a stdio server, over the MCP SDK's minimal default environment."
    )
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers (e.g. Authorization).")

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError("an MCP server needs exactly one of `command` (stdio) or `url` (streamable HTTP)")
        return self

    @classmethod
    def stdio(cls, command: str, args: tuple[str, ...] | list[str] = (), *, name: str | None = None,
              env: dict[str, str] | None = None, cwd: str | None = None) -> McpServer:
        """A server started as a subprocess and spoken to over its stdin/stdout."""
        return cls(name=name or command, command=command, args=tuple(args), env=env, cwd=cwd)

    @classmethod
    def http(cls, url: str, *, name: str | None = None, headers: dict[str, str] | None = None) -> McpServer:
        """A server reached over streamable HTTP."""
        return cls(name=name or url, url=url, headers=headers or {})

    @property
    def key(self) -> str:
        return self.model_dump_json()


@asynccontextmanager
async def open_session(server: McpServer) -> AsyncIterator[ClientSession]:
    """An initialized client session to `server`, closed (and a stdio server stopped) on exit."""
    async with AsyncExitStack() as stack:
        if server.url is not None:
            client = await stack.enter_async_context(httpx2.AsyncClient(headers=server.headers))
            read, write = await stack.enter_async_context(streamable_http_client(server.url, http_client=client))
        else:
            assert server.command is not None
            params = StdioServerParameters(command=server.command, args=list(server.args), env=server.env,
                                           cwd=server.cwd)
            read, write = await stack.enter_async_context(stdio_client(params))
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        yield session


async def list_tools(server: McpServer) -> list[types.Tool]:
    """Every tool the server lists (all pages), over a short-lived session."""
    async with open_session(server) as session:
        tools: list[types.Tool] = []
        cursor: str | None = None
        while True:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                return tools


def run_blocking(coro_factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from sync code, even when the caller is inside an event loop."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(coro_factory())).result()


class _Live:
    """A session kept open by a task on the pool's loop until `close()`."""

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self.ready: asyncio.Future[ClientSession] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._hold(), name=f"mcp-session:{server.name}")

    async def _hold(self) -> None:
        try:
            async with open_session(self.server) as session:
                if not self.ready.done():
                    self.ready.set_result(session)
                await asyncio.Event().wait()
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
            raise

    def usable(self) -> bool:
        """Still open, or still opening."""
        if self.task.done():
            return False
        return not self.ready.done() or (not self.ready.cancelled() and self.ready.exception() is None)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class SessionPool:
    """The sessions of this process, on a private event-loop thread (thread-safe; fork-aware)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, _Live] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _loop_here(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._pid != os.getpid() or self._loop is None:
                # After a fork the parent's loop thread does not exist here: start afresh and
                # leave the parent's sessions (and their servers) to the parent.
                self._live, self._locks = {}, {}
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="toolchord-mcp", daemon=True).start()
                self._pid = os.getpid()
            return self._loop

    async def _session(self, server: McpServer) -> ClientSession:
        # One caller at a time checks (and if need be replaces) a server's session, so concurrent
        # calls never start two; shielded, so a caller that times out cancels only its own wait.
        lock = self._locks.setdefault(server.key, asyncio.Lock())
        async with lock:
            live = self._live.get(server.key)
            if live is not None and live.usable():
                session = await asyncio.shield(live.ready)
                try:
                    await asyncio.wait_for(session.send_ping(), _PING_SECONDS)
                    return session
                except (TimeoutError, MCPError, OSError):
                    pass
            if live is not None:
                await live.close()
            live = self._live[server.key] = _Live(server)
            return await asyncio.shield(live.ready)

    async def _call(self, server: McpServer, tool: str, arguments: dict[str, Any]) -> types.CallToolResult:
        try:
            session = await self._session(server)
        except Exception as exc:
            raise ConnectionError(f"cannot reach MCP server {server.name!r}: {exc!r}") from exc
        try:
            result = await session.call_tool(tool, arguments)
        except MCPError as exc:
            if exc.error.code == types.CONNECTION_CLOSED:
                raise HandlerLost(f"MCP server {server.name!r} went away during the call") from exc
            raise
        if not isinstance(result, types.CallToolResult):
            raise RuntimeError(f"MCP server {server.name!r} answered {type(result).__name__}, not a tool result")
        return result

    def call(self, server: McpServer, tool: str, arguments: dict[str, Any], timeout: float) -> types.CallToolResult:
        """Call a tool, waiting at most `timeout` seconds (then the request is cancelled: HandlerTimeout)."""
        future = asyncio.run_coroutine_threadsafe(self._call(server, tool, arguments), self._loop_here())
        try:
            return future.result(timeout)
        except (concurrent.futures.TimeoutError, HandlerTimeout):
            # On a worker the tool's own timer (worker/handler_deadline.py) may raise HandlerTimeout
            # in this wait first: the request is cancelled either way.
            future.cancel()
            raise HandlerTimeout(f"no answer from MCP server {server.name!r} within {timeout:g} s") from None


SESSIONS = SessionPool()

__all__ = ["SESSIONS", "McpServer", "SessionPool", "list_tools", "open_session", "run_blocking"]
