"""Waiting for a chord's result without a thread per waiting turn.

With the Redis result backend, Celery publishes each result on a channel named after its key;
`RedisResultWaiter` keeps one pub/sub connection per event loop for every waiting turn. The
embedded backend has no notifications, so `PollingResultWaiter` polls it with a short backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Protocol

import redis.asyncio as aioredis
from celery import Celery, states

log = logging.getLogger("toolchord.orchestrator")


class ResultWaiter(Protocol):
    async def wait(self, task_id: str, timeout: float) -> dict[str, Any] | None:
        """The task's result meta once it is ready (`status`, `result`), or None on timeout."""
        ...

    async def close(self) -> None: ...


class PollingResultWaiter:
    """Polls the app's result backend (the embedded in-memory one has no notifications)."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    async def wait(self, task_id: str, timeout: float) -> dict[str, Any] | None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        delay = 0.001
        while True:
            meta = self.app.backend.get_task_meta(task_id)
            if meta.get("status") in states.READY_STATES:
                return meta
            if loop.time() >= end:
                return None
            await asyncio.sleep(min(delay, max(end - loop.time(), 0)))
            delay = min(delay * 2, 0.05)

    async def close(self) -> None:
        return None


class RedisResultWaiter:
    """One pub/sub subscription per waited task, all on one connection for this event loop."""

    def __init__(self, url: str, key_prefix: str = "celery-task-meta-") -> None:
        self._redis = aioredis.Redis.from_url(url)
        self._prefix = key_prefix
        self._pubsub: aioredis.client.PubSub | None = None
        self._waiters: dict[str, list[asyncio.Future[dict[str, Any]]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def _ensure_reader(self) -> aioredis.client.PubSub:
        if self._pubsub is None:
            self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(self._pubsub), name="toolchord-result-reader")
        return self._pubsub

    async def _read(self, pubsub: aioredis.client.PubSub) -> None:
        while self._waiters or pubsub.subscribed:
            try:
                message = await pubsub.get_message(timeout=1.0)
            except (aioredis.ConnectionError, RuntimeError) as exc:
                log.warning("result subscription interrupted (%s); waiters fall back to polling", exc)
                await asyncio.sleep(0.2)
                continue
            if message is None or message.get("type") != "message":
                continue
            channel = message["channel"].decode()
            meta = json.loads(message["data"])
            if meta.get("status") in states.READY_STATES:
                for future in self._waiters.pop(channel, []):
                    if not future.done():
                        future.set_result(meta)

    async def _get(self, channel: str) -> dict[str, Any] | None:
        raw = await self._redis.get(channel)
        if raw is None:
            return None
        meta = json.loads(raw)
        return meta if meta.get("status") in states.READY_STATES else None

    async def wait(self, task_id: str, timeout: float) -> dict[str, Any] | None:
        channel = self._prefix + task_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        async with self._lock:
            pubsub = await self._ensure_reader()
            first = channel not in self._waiters
            self._waiters.setdefault(channel, []).append(future)
            if first:
                await pubsub.subscribe(channel)
        try:
            # The result may have been stored before the subscription took effect.
            ready = await self._get(channel)
            if ready is not None:
                return ready
            try:
                return await asyncio.wait_for(asyncio.shield(future), timeout)
            except asyncio.TimeoutError:
                # A missed message (connection blip) must not cost the result: look once more.
                return await self._get(channel)
        finally:
            async with self._lock:
                waiting = self._waiters.get(channel, [])
                if future in waiting:
                    waiting.remove(future)
                if not waiting:
                    self._waiters.pop(channel, None)
                    if self._pubsub is not None:
                        await self._pubsub.unsubscribe(channel)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._pubsub is not None:
            await self._pubsub.aclose()
        await self._redis.aclose()
