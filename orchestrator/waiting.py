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
    async def expect(self, task_id: str) -> None:
        """Start listening for the task's result before the task is sent (the first `wait` soon follows)."""
        ...

    async def wait(self, task_id: str, timeout: float) -> dict[str, Any] | None:
        """The task's result meta once it is ready (`status`, `result`), or None on timeout."""
        ...

    async def close(self) -> None: ...


class PollingResultWaiter:
    """Polls the app's result backend (the embedded in-memory one has no notifications)."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    async def expect(self, task_id: str) -> None:
        return None

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


class _ConnectCountingPubSub(aioredis.client.PubSub):
    """redis-py's pub/sub, counting its connections: after the first, each one is a reconnect, which
    subscribes to the channels again by itself but loses whatever was published in between."""

    connects = 0

    async def on_connect(self, connection: Any) -> None:
        self.connects += 1
        await super().on_connect(connection)


class RedisResultWaiter:
    """Every waiting turn of this event loop on one pub/sub connection, plus a small command pool.

    Found under load (orchestrator/bench/load.py, 1,000 turns waiting at once):
    - each wait used to take a connection of its own for its GET, and redis-py's default pool
      raises "Too many connections" past 100: GETs now share a blocking pool of
      `max_connections` and queue for it instead;
    - a turn re-waits every second (to look at its cancel flag), which used to cost an
      UNSUBSCRIBE, a SUBSCRIBE and a GET per turn per second: a channel now stays subscribed for
      `linger` seconds after its last waiter leaves, and a result that arrives in that gap is kept
      for the next wait, so a re-wait costs no Redis command at all.

    - a wait that timed out used to GET the result in case a message was missed: one GET per
      waiting turn per second. Messages are missed only across a reconnect of the pub/sub
      connection (redis-py subscribes again by itself), so a channel's result is read again only
      when the connection was made again since the channel last looked.

    A channel subscribed through `expect` before its task was sent needs no GET at its first wait:
    nothing can have been published on it before the subscription. (The SUBSCRIBE is written before
    the chord's publish starts; should Redis still see it after the callback's result, the turn
    finds its calls' results in the idempotency store at its next look, within 5 s.)
    """

    def __init__(
        self, url: str, key_prefix: str = "celery-task-meta-", *, max_connections: int = 8, linger: float = 5.0
    ) -> None:
        self._redis = aioredis.Redis(
            connection_pool=aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=None)
        )
        self._prefix = key_prefix
        self._linger = linger
        self._pubsub: _ConnectCountingPubSub | None = None
        self._waiters: dict[str, list[asyncio.Future[dict[str, Any]]]] = {}
        # Per subscribed channel: the pub/sub connection count when it last could not miss a result
        # (subscribed, or its result key read); another connection since means it may have.
        self._looked: dict[str, int] = {}
        # Subscribed channels without a waiter right now: when to unsubscribe, and a result that came.
        self._idle: dict[str, float] = {}
        self._arrived: dict[str, dict[str, Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def waiting(self) -> int:
        """How many tasks are being waited for right now."""
        return len(self._waiters)

    async def _ensure_tasks(self) -> _ConnectCountingPubSub:
        if self._pubsub is None:
            self._pubsub = _ConnectCountingPubSub(self._redis.connection_pool, ignore_subscribe_messages=True)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(self._pubsub), name="toolchord-result-reader")
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap(), name="toolchord-result-unsubscriber")
        return self._pubsub

    async def _read(self, pubsub: _ConnectCountingPubSub) -> None:
        while self._waiters or self._idle:
            if not pubsub.subscribed:
                await asyncio.sleep(0.01)
                continue
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
            if meta.get("status") not in states.READY_STATES:
                continue
            futures = self._waiters.get(channel)
            if futures:
                for future in futures:
                    if not future.done():
                        future.set_result(meta)
            elif channel in self._idle:
                self._arrived[channel] = meta

    async def _reap(self) -> None:
        """Unsubscribe channels nobody has waited for during `linger` seconds."""
        loop = asyncio.get_running_loop()
        while self._waiters or self._idle:
            await asyncio.sleep(min(self._linger, 1.0))
            now = loop.time()
            expired = [channel for channel, since in self._idle.items() if now - since >= self._linger]
            if not expired:
                continue
            async with self._lock:
                expired = [c for c in expired if c in self._idle and c not in self._waiters]
                for channel in expired:
                    del self._idle[channel]
                    self._arrived.pop(channel, None)
                    self._looked.pop(channel, None)
                if expired and self._pubsub is not None:
                    await self._pubsub.unsubscribe(*expired)

    async def expect(self, task_id: str) -> None:
        channel = self._prefix + task_id
        try:
            async with self._lock:
                if channel in self._waiters or channel in self._idle:
                    return
                # Idle until its first wait: the reaper unsubscribes it if that wait never comes.
                self._idle[channel] = asyncio.get_running_loop().time()
                pubsub = await self._ensure_tasks()
                try:
                    await pubsub.subscribe(channel)
                except BaseException:
                    del self._idle[channel]
                    raise
                self._looked[channel] = pubsub.connects
        except (aioredis.RedisError, OSError) as exc:
            # The first wait subscribes (and looks at the result key) itself.
            log.warning("listening for %s: %s", task_id, exc)

    def _may_have_missed(self, channel: str) -> bool:
        """Whether a result published on `channel` may have been lost (a reconnect since it looked)."""
        return self._pubsub is None or self._looked.get(channel) != self._pubsub.connects

    async def _get(self, channel: str) -> dict[str, Any] | None:
        if self._pubsub is not None:
            self._looked[channel] = self._pubsub.connects
        raw = await self._redis.get(channel)
        if raw is None:
            return None
        meta = json.loads(raw)
        return meta if meta.get("status") in states.READY_STATES else None

    async def wait(self, task_id: str, timeout: float) -> dict[str, Any] | None:
        try:
            return await self._wait(task_id, timeout)
        except (aioredis.RedisError, OSError) as exc:
            # Redis is unreachable: the turn keeps to its deadline, then the idempotency store
            # supplies what finished (as the blocking path does).
            log.warning("waiting for %s: %s", task_id, exc)
            await asyncio.sleep(min(max(timeout, 0), 0.25))
            return None

    async def _wait(self, task_id: str, timeout: float) -> dict[str, Any] | None:
        channel = self._prefix + task_id
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        async with self._lock:
            pubsub = await self._ensure_tasks()
            subscribed = channel in self._waiters or channel in self._idle
            self._idle.pop(channel, None)
            arrived = self._arrived.pop(channel, None)
            self._waiters.setdefault(channel, []).append(future)
            if not subscribed:
                await pubsub.subscribe(channel)
        try:
            if arrived is not None:
                return arrived
            if not subscribed or self._may_have_missed(channel):
                # The result may have been stored before the subscription took effect, or
                # published while the connection was being made again.
                ready = await self._get(channel)
                if ready is not None:
                    return ready
            try:
                return await asyncio.wait_for(asyncio.shield(future), max(timeout, 0))
            except TimeoutError:
                # A message missed across a reconnect must not cost the result: look once more.
                return await self._get(channel) if self._may_have_missed(channel) else None
        finally:
            waiting = self._waiters.get(channel, [])
            if future in waiting:
                waiting.remove(future)
            if not waiting:
                self._waiters.pop(channel, None)
                # Keep the subscription a while: the caller usually waits again right away. Once
                # the result is in, nobody needs the channel: the reaper drops it on its next round.
                delivered = future.done() and not future.cancelled()
                self._idle[channel] = loop.time() - (self._linger if delivered else 0.0)

    async def close(self) -> None:
        for task in (self._reader, self._reaper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._waiters.clear()
        self._idle.clear()
        self._arrived.clear()
        self._looked.clear()
        if self._pubsub is not None:
            await self._pubsub.aclose()
        await self._redis.aclose()
