"""The asyncio result waiter reads a result key only when it could have missed its message.

A waiting turn re-waits every second; each timed-out wait used to GET the callback's result key
(one command per waiting turn per second at a thousand turns). Messages are lost only across a
reconnect of the pub/sub connection, so the key is read only then (orchestrator/waiting.py).
"""

from __future__ import annotations

import asyncio
import json

import redis

from tests.cluster_helpers import wait_for
from toolchord.orchestrator.waiting import RedisResultWaiter

_META = {"status": "SUCCESS", "result": [], "task_id": "t-stored"}


def _gets(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_get", {}).get("calls", 0))


def test_a_wait_that_times_out_reads_nothing_without_a_reconnect(redis_url, clean_redis):
    async def run() -> dict[str, object] | None:
        waiter = RedisResultWaiter(redis_url)
        try:
            await waiter.expect("t-quiet")
            return await waiter.wait("t-quiet", 0.3) or await waiter.wait("t-quiet", 0.3)
        finally:
            await waiter.close()

    clean_redis.config_resetstat()
    assert asyncio.run(run()) is None
    assert _gets(clean_redis) == 0


def test_a_result_published_across_a_reconnect_is_read_from_its_key(redis_url, clean_redis):
    """The result is stored while the pub/sub connection is away (its message never arrives): the
    waiter, seeing that it connected again, reads the key."""

    async def run() -> dict[str, object] | None:
        waiter = RedisResultWaiter(redis_url)
        try:
            await waiter.expect("t-stored")
            clean_redis.set("celery-task-meta-t-stored", json.dumps(_META))
            killed = clean_redis.client_kill_filter(_type="pubsub")
            assert killed >= 1
            wait_for(lambda: clean_redis.pubsub_numsub("celery-task-meta-t-stored")[0][1] == 0, 10,
                     "the pub/sub connection to be gone")
            return await waiter.wait("t-stored", 2.0) or await waiter.wait("t-stored", 2.0)
        finally:
            await waiter.close()

    meta = asyncio.run(run())
    assert meta is not None and meta["status"] == "SUCCESS", meta
