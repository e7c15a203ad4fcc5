"""RedisTurnStore against a real redis-server: a turn's start and end, and the late calls they keep."""

from __future__ import annotations

import time

import redis

from toolchord.orchestrator.turn import LateCall, TurnRecord, TurnResult
from toolchord.orchestrator.turn_store import RedisTurnStore
from toolchord.worker.models import ToolCall

TTL = 300


def _record(turn_id: str) -> TurnRecord:
    call = ToolCall(id="call_0", name="lookup", arguments_raw="{}")
    return TurnRecord(session_id="s", turn_id=turn_id, provider="chat", calls=[call], deadline=time.time() + 60)


def _late(key: str, turn_id: str) -> LateCall:
    return LateCall(call=ToolCall(id=f"c-{key}", name="lookup", arguments_raw="{}"), key=key, turn_id=turn_id,
                    reported="TIMEOUT")


def test_finish_stores_result_and_done_record_and_keeps_the_late_calls_of_the_session(clean_redis: redis.Redis) -> None:
    store = RedisTurnStore(clean_redis, TTL)
    # An earlier turn left two late calls; this turn reports one of them (settled) and leaves one of
    # its own behind (watched).
    clean_redis.hset("toolchord:late:s", mapping={"k-old": _late("k-old", "t0").model_dump_json(),
                                                  "k-kept": _late("k-kept", "t0").model_dump_json()})
    record = _record("t1")
    found, late = store.begin(record)
    assert found == record
    assert sorted(c.key for c in late) == ["k-kept", "k-old"]
    assert store.active("s") == record

    result = TurnResult(session_id="s", turn_id="t1", provider="chat", calls=record.calls, results=[])
    store.finish(record, result, settled_late=["k-old"], watched=[_late("k-new", "t1")])

    assert store.result("s", "t1") == result
    stored_record = store.record("s", "t1")
    assert stored_record is not None and stored_record.status == "done"
    assert store.active("s") is None
    found_again, late_now = store.find("s", "t1")
    assert found_again == result
    assert sorted(c.key for c in late_now) == ["k-kept", "k-new"]
    assert LateCall.model_validate_json(clean_redis.hget("toolchord:late:s", "k-new")) == _late("k-new", "t1")
    assert 0 < clean_redis.ttl("toolchord:late:s") <= TTL
    for part in ("record", "result"):
        assert 0 < clean_redis.ttl(f"toolchord:turn:s:t1:{part}") <= TTL
    # A resubmission of the finished turn gets its result back, and saves nothing.
    again, _ = store.begin(_record("t1"))
    assert again == result
    resubmitted_record = store.record("s", "t1")
    assert resubmitted_record is not None and resubmitted_record.status == "done"
    assert store.active("s") is None


def test_begin_runs_after_the_script_cache_is_lost_and_finish_without_late_calls_leaves_no_late_hash(
    clean_redis: redis.Redis,
) -> None:
    store = RedisTurnStore(clean_redis, TTL)
    # Redis forgets loaded scripts on a restart (or SCRIPT FLUSH): the store loads its own again.
    store.begin(_record("t0"))
    clean_redis.script_flush()
    record = _record("t1")
    assert store.begin(record) == (record, [])
    result = TurnResult(session_id="s", turn_id="t1", provider="chat", calls=record.calls, results=[])
    store.finish(record, result)
    assert store.result("s", "t1") == result
    assert not clean_redis.exists("toolchord:late:s")
