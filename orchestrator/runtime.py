"""The orchestrator: one model turn → checks → a Celery chord → one result per call, in order.

A turn never hangs: it has a deadline, and calls without a result by then get `NOT_EXECUTED`
(never started, and now prevented from starting), `TIMEOUT` or `OUTCOME_UNKNOWN` (started; their
late results are kept and reported in the session's next turn).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

import redis
from celery import Celery, chain, chord, states
from celery.backends.redis import RedisBackend
from celery.canvas import Signature
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.exceptions import OperationalError

from toolchord.orchestrator.approval_store import Approval
from toolchord.orchestrator.approvals import ApprovalDesk, needs_approval
from toolchord.orchestrator.cancel_signals import announce_cancel, listen_for_cancels
from toolchord.orchestrator.event_stores import EventLog
from toolchord.orchestrator.fair_share import call_priority
from toolchord.orchestrator.observability import observed_turn
from toolchord.orchestrator.pipeline import PermissionHook, PreparedCall, prepare_call
from toolchord.orchestrator.providers import get_adapter
from toolchord.orchestrator.stores import OrchestratorStores, stores_for
from toolchord.orchestrator.turn import DispatchedCall, LateCall, TurnRecord, TurnResult
from toolchord.orchestrator.turn_store import TurnStore
from toolchord.orchestrator.waiting import PollingResultWaiter, RedisResultWaiter, ResultWaiter
from toolchord.worker import errors
from toolchord.worker.celery_app import WorkerRuntime, create_app, runtime_of
from toolchord.worker.config import Settings
from toolchord.worker.idempotency import ClaimState
from toolchord.worker.models import ErrorCode, ToolCall, ToolResult
from toolchord.worker.payloads import CallPayload, cancel_scope
from toolchord.worker.policy import policy_of
from toolchord.worker.registry import Provider, Registry
from toolchord.worker.store_errors import StoreUnavailable
from toolchord.worker.tasks import COLLECT_TASK, TASK_NAMES, with_lost_results
from toolchord.worker.tools import PriorityClass

log = logging.getLogger("toolchord.orchestrator")

# Slack over the handler timeout for Celery's own limits: the sandbox kills the handler first.
_SOFT_LIMIT_SLACK = 5.0
_HARD_LIMIT_SLACK = 10.0
# How long one wait for a turn's result lasts before the turn looks at its cancel state again.
_CANCEL_POLL = 0.25
# How often a waiting turn reads its cancel flag in Redis and looks for its calls' stored results.
# Cancels made here, and cancels that other processes announce on the cancel channel, are seen at
# the next wait slice without it; the read covers an announcement lost to a reconnect. The stored
# results cover a chord callback that is never sent: a worker killed after taking Celery's
# callback-dispatch claim (a Redis key that outlives the broker's redelivery of its task) leaves
# the chord complete with nobody to send the callback. One round trip per waiting turn per second
# adds up at a thousand waiting turns.
_REMOTE_CANCEL_POLL = 5.0


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _release_pending(backend: Any, task_ids: list[str]) -> None:
    """Stop waiting for results that call tasks never store (they run with ignore_result).

    Celery's Redis backend builds a GroupResult of the header in `apply_chord` only to inspect
    it, and that registers every header task as a pending result and subscribes to its result
    channel; those would stay for the life of the process, one per call. The registry is
    private to Celery (celery>=5.7 is required), so this reaches into it, and only drops what
    is there.
    """
    pending = getattr(backend, "_pending_results", None)
    if pending is None:
        return
    for task_id in task_ids:
        for mapping in pending:
            for result in list(mapping.get(task_id, {}).values()):
                backend.remove_pending_result(result)


def _is_unknown(result: ToolResult) -> bool:
    return result.error is not None and result.error.code == ErrorCode.OUTCOME_UNKNOWN


def _not_executed(result: ToolResult) -> bool:
    return result.error is not None and result.error.code == ErrorCode.NOT_EXECUTED


def _may_still_finish(dc: DispatchedCall, code: ErrorCode, unfinished: bool) -> bool:
    """Whether a result stored later may supersede the error the turn reports for this call: the
    turn gave up on it while it ran, or it is an unsafe call reported OUTCOME_UNKNOWN (its first
    attempt may have been slow rather than lost)."""
    if unfinished:
        return code != ErrorCode.NOT_EXECUTED
    return policy_of(dc.side_effect).unobserved_is_unknown and code == ErrorCode.OUTCOME_UNKNOWN


class _RemoteCancelClock:
    """Says when a waiting turn should next ask Redis for its cancel flag."""

    def __init__(self) -> None:
        self._next = time.monotonic() + _REMOTE_CANCEL_POLL

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + _REMOTE_CANCEL_POLL
        return True


class Orchestrator:
    """Runs model turns on a Celery app made by `toolchord.create_app` (embedded when `app` is None)."""

    def __init__(
        self,
        registry: Registry,
        app: Celery | None = None,
        *,
        settings: Settings | None = None,
        turn_timeout: float | None = None,
        permission_hook: PermissionHook | None = None,
        event_log: EventLog | None = None,
        tenant: str | None = None,
        priority: PriorityClass = "interactive",
    ) -> None:
        self.app = app if app is not None else create_app(settings, registry)
        self.runtime: WorkerRuntime = runtime_of(self.app)
        # A copy, so the caller's registry is left as it was; it also knows the runtime's built-ins.
        self.registry = Registry(registry)
        self.registry.add_missing(self.runtime.registry)
        self.turn_timeout = turn_timeout
        self.permission_hook = permission_hook
        # Flow control (docs/flow-control.md): limit keys see the tenant; priority orders the queue.
        self.tenant = tenant
        self.priority: PriorityClass = priority
        settings = self.runtime.settings
        self.stores: OrchestratorStores = stores_for(settings, self.runtime.stores)
        self.turns: TurnStore = self.stores.turns
        # Calls held for a decision; decisions are written to `event_log` (default: the configured log).
        self.approvals = ApprovalDesk(self, self.stores.approvals, event_log)
        self._waiters: dict[asyncio.AbstractEventLoop, ResultWaiter] = {}
        # Turns waited on here, and those of them known to be cancelled (by this orchestrator or
        # announced by another process): the waiting loops check the set at every slice.
        self._waiting: set[tuple[str, str]] = set()
        self._cancelled_here: set[tuple[str, str]] = set()
        self._listening = False
        # Call tasks keep no per-task result where the chord does not need one: the Redis backend
        # joins a chord from its own list (on_chord_part_return runs whatever ignore_result says),
        # and the idempotency store keeps each result by key. A per-task copy would cost a GET and
        # a SET/PUBLISH per call on the worker and a result subscription per call here. Other
        # backends (the embedded cache) join by reading each task's result, so they keep it.
        self._ignore_call_results = isinstance(self.app.backend, RedisBackend)
        if settings.embedded:
            self.runtime.registry.add_missing(registry)
            self.runtime.start_embedded_worker(self.app)

    # -- planning -----------------------------------------------------------------------------

    def _deadline(self, groups: list[list[DispatchedCall]]) -> float:
        if self.turn_timeout is not None:
            return time.time() + self.turn_timeout
        longest = 0.0
        for group in groups:
            total = 0.0
            for dc in group:
                spec = self.registry[dc.call.name]
                # Repeatable calls may be retried once after a timeout.
                total += spec.timeout * policy_of(spec.side_effect).deadline_attempts + 2
            longest = max(longest, total)
        return time.time() + longest + 5

    def plan(self, session_id: str, turn_id: str, calls: list[ToolCall], provider: Provider) -> TurnRecord:
        """Check every call and group the valid ones: one chain per shared resource, in model order.

        Only the first `max_calls_per_turn` calls (model order) are checked and may run; each call
        past the cap gets a NOT_EXECUTED result without being read.
        """
        settings = self.runtime.settings
        early: list[ToolResult] = []
        by_resource: dict[str, list[DispatchedCall]] = {}
        groups: list[list[DispatchedCall]] = []
        dispatched: list[DispatchedCall] = []
        awaiting: list[DispatchedCall] = []
        for position, call in enumerate(sorted(calls, key=lambda c: c.index)):
            if position >= settings.max_calls_per_turn:
                early.append(errors.error_result(call, errors.over_call_cap(call, len(calls), settings.max_calls_per_turn)))
                continue
            prepared = prepare_call(
                call, self.registry, session_id, self.permission_hook, max_argument_bytes=settings.max_argument_bytes
            )
            if isinstance(prepared, ToolResult):
                early.append(prepared)
                continue
            dc = self._dispatched(prepared)
            if needs_approval(self.registry[call.name], prepared.arguments):
                awaiting.append(dc)
                continue
            dispatched.append(dc)
            if prepared.resource is None:
                groups.append([dc])
            elif prepared.resource in by_resource:
                by_resource[prepared.resource].append(dc)
            else:
                by_resource[prepared.resource] = [dc]
                groups.append(by_resource[prepared.resource])
        return TurnRecord(
            session_id=session_id,
            turn_id=turn_id,
            provider=provider,
            calls=list(calls),
            early=early,
            dispatched=dispatched,
            awaiting=awaiting,
            groups=[[dc.call.id for dc in group] for group in groups],
            deadline=self._deadline(groups),
            tenant=self.tenant,
            priority=self.priority,
        )

    def _dispatched(self, prepared: PreparedCall) -> DispatchedCall:
        spec = self.registry[prepared.call.name]
        return DispatchedCall(
            call=prepared.call,
            arguments=prepared.arguments,
            key=prepared.idempotency_key,
            # Stable across resubmission (same key and call), unique within a turn.
            task_id="tc-" + _digest(prepared.idempotency_key, prepared.call.id),
            side_effect=spec.side_effect,
        )

    def _signature(self, record: TurnRecord, dc: DispatchedCall, first: bool, rank: int = 0) -> Signature:
        spec = self.registry[dc.call.name]
        payload = CallPayload(
            call=dc.call,
            arguments=dc.arguments,
            key=dc.key,
            session_id=record.session_id,
            turn_id=record.turn_id,
            deadline=record.deadline,
            tenant=record.tenant,
        )
        isolated = spec.sandbox.isolate
        return self.app.signature(
            TASK_NAMES[spec.side_effect],
            kwargs={"payload": payload.model_dump(mode="json")},
            immutable=first,
            task_id=dc.task_id,
            queue=self.runtime.queue(spec.queue),
            soft_time_limit=spec.timeout + (_SOFT_LIMIT_SLACK if isolated else 0),
            time_limit=spec.timeout + _HARD_LIMIT_SLACK,
            # Tool arguments stay out of events and Flower: show the tool and the call id only.
            argsrepr=f"{dc.call.name} call={dc.call.id}",
            kwargsrepr="{}",
            ignore_result=self._ignore_call_results,
            priority=call_priority(rank, record.priority, spec.priority),
        )

    def _dispatch(self, record: TurnRecord) -> str | None:
        """Send the chord; returns the callback's task id (None when nothing needs a worker)."""
        if not record.dispatched:
            return None
        by_id = {dc.call.id: dc for dc in record.dispatched}
        rank = {dc.call.id: position for position, dc in enumerate(record.dispatched)}
        header = []
        for group in record.groups:
            sigs = [self._signature(record, by_id[cid], first=i == 0, rank=rank[cid]) for i, cid in enumerate(group)]
            header.append(sigs[0] if len(sigs) == 1 else chain(*sigs))
        body_id = "tc-collect-" + _digest(record.session_id, record.turn_id, str(time.time_ns()))
        # Every header message carries a copy of the body (docs/architecture.md, "Celery behaviour"), so the body
        # has no per-call arguments: the orchestrator orders the results from its own record.
        body = self.app.signature(COLLECT_TASK, task_id=body_id, queue=self.runtime.queue())
        # chord() explicitly, never chain(group, body): a one-task group would unroll (same section).
        chord(header, body).apply_async()
        if self._ignore_call_results:
            _release_pending(self.app.backend, [dc.task_id for dc in record.dispatched])
        return body_id

    def _dispatch_patiently(self, record: TurnRecord) -> str | None:
        """`_dispatch`, waiting up to the turn's deadline for a broker that cannot be reached (a
        restart, a failover); OperationalError when it still cannot be reached then."""
        try:
            return self._dispatch(record)
        except OperationalError as exc:
            log.warning("turn %s: the broker is unreachable (%s); waiting for it until the deadline", record.turn_id, exc)
        # Celery's publish retry cannot cover this: kombu connects a producer with the connection's
        # own options, not the publish's retry policy (kombu issues 735, 1024). Resending is safe: a
        # resubmitted chord keeps its task ids and keys.
        with self.app.connection_for_write() as connection:
            connection.ensure_connection(
                timeout=max(record.deadline - time.time(), 0.001), interval_start=0, interval_step=0.5, interval_max=1
            )
        return self._dispatch(record)

    # -- finishing ----------------------------------------------------------------------------

    def _finish(self, record: TurnRecord, collected: list[dict[str, Any]] | None, reason: str) -> TurnResult:
        """Merge early, collected and missing results into one per call in model order."""
        by_id: dict[str, ToolResult] = {r.call_id: r for r in record.early}
        for item in collected or []:
            result = ToolResult.model_validate(item)
            by_id.setdefault(result.call_id, result)
        # The idempotency store's result wins whenever it exists: over a missing result, and over
        # an error the chord may have synthesized (a result lost on its way, a worker's internal
        # error after storing). An ok result only ever comes from the store or its own handler.
        unsettled = [dc for dc in record.dispatched if (found := by_id.get(dc.call.id)) is None or found.status == "error"]
        unfinished: set[str] = set()
        if unsettled:
            stored = self._stored_results([dc.key for dc in unsettled])
            for dc, raw in zip(unsettled, stored, strict=True):
                if raw is not None:
                    by_id[dc.call.id] = ToolResult.model_validate_json(raw).model_copy(update={"call_id": dc.call.id})
                elif (found := by_id.get(dc.call.id)) is None or _not_executed(found):
                    # A worker's NOT_EXECUTED is settled here again: one that could not reach Redis
                    # left the call able to start later.
                    by_id[dc.call.id], was_stored = self._unfinished(record, dc, reason, found)
                    if not was_stored:
                        unfinished.add(dc.call.id)
        watched = [
            LateCall(call=dc.call, key=dc.key, turn_id=record.turn_id, reported=error.code.value)
            for dc in record.dispatched
            if (error := by_id[dc.call.id].error) is not None and _may_still_finish(dc, error.code, dc.call.id in unfinished)
        ]
        results = [by_id[call.id] for call in sorted(record.calls, key=lambda c: c.index) if call.id in by_id]
        late_results, settled = self._late_results(record)
        turn = TurnResult(
            session_id=record.session_id,
            turn_id=record.turn_id,
            provider=record.provider,
            calls=record.calls,
            results=results,
            late_results=late_results,
            awaiting_approval=self.approvals.awaiting(record),
        )
        self.turns.finish(record, turn, settled, watched)
        self._stop_watching(record)
        return turn

    def _stop_watching(self, record: TurnRecord) -> None:
        """This process no longer waits for the turn (finished, or its waiter was cancelled)."""
        self._waiting.discard((record.session_id, record.turn_id))
        self._cancelled_here.discard((record.session_id, record.turn_id))

    def _stored_results(self, keys: list[str]) -> list[str | None]:
        return self.runtime.store.results(keys)

    def _unfinished(
        self, record: TurnRecord, dc: DispatchedCall, reason: str, not_run: ToolResult | None = None
    ) -> tuple[ToolResult, bool]:
        """The truthful result for a call that has none when the turn ends (or only `not_run`, a
        worker's NOT_EXECUTED), and whether it is the stored one."""
        # One atomic step: a stored result is taken, a recorded start means the call began, and
        # otherwise the cancel flag is set, which every later claim refuses (no call is reported
        # NOT_EXECUTED and then run).
        settled = self.runtime.store.settle(dc.key, cancel_scope(record.turn_id, dc.key), self.runtime.settings.result_ttl)
        if settled.state is ClaimState.STORED and settled.result_json is not None:
            return ToolResult.model_validate_json(settled.result_json).model_copy(update={"call_id": dc.call.id}), True
        if not_run is None:
            try:
                self.app.control.revoke(dc.task_id)
            except OperationalError as exc:
                # Only a shortcut for workers: the settled key already keeps the call from starting.
                log.warning("could not revoke call %s: %s", dc.call.id, exc)
        if settled.state is ClaimState.CANCELLED:
            return not_run or errors.error_result(dc.call, errors.not_executed(dc.call, reason)), False
        reason = reason or "the turn ended"
        if policy_of(dc.side_effect).unobserved_is_unknown:
            error = errors.outcome_unknown(dc.call, f"{reason} while it was running")
        elif reason.startswith("the turn was cancelled"):
            error = errors.cancelled(dc.call)
        else:
            # The turn stopped waiting; the tool's own timeout did not stop the call.
            error = errors.turn_stopped_waiting(dc.call, reason)
        return errors.error_result(dc.call, error), False

    def _late_results(self, record: TurnRecord) -> tuple[list[ToolResult], list[str]]:
        """Results that arrived for earlier turns' late calls, and those calls' keys."""
        pending = [late for late in record._late if late.turn_id != record.turn_id]
        if not pending:
            return [], []
        found: list[ToolResult] = []
        settled: list[str] = []
        for late, raw in zip(pending, self._stored_results([p.key for p in pending]), strict=True):
            if raw is None:
                continue
            result = ToolResult.model_validate_json(raw).model_copy(update={"call_id": late.call.id})
            if late.reported == ErrorCode.OUTCOME_UNKNOWN.value and _is_unknown(result):
                continue  # still the stand-in the model was given: no news yet
            found.append(result)
            settled.append(late.key)
        return found, settled

    # -- running ------------------------------------------------------------------------------

    def _start(
        self, session_id: str, calls: list[ToolCall], provider: Provider, turn_id: str | None
    ) -> TurnResult | tuple[TurnRecord, str]:
        """Plan and dispatch the turn (or find it): a finished TurnResult, or the record and callback id."""
        turn_id = turn_id or _digest(session_id, *(c.id for c in calls))
        found, late = self.turns.find(session_id, turn_id)
        if isinstance(found, TurnResult):
            return found
        record = found
        if record is None:
            record = self.plan(session_id, turn_id, calls, provider)
            self.turns.save(record)
        # Idempotent: a turn resumed after a crash between the two writes still records its held calls.
        self.approvals.request(record)
        record._late = tuple(late)
        turn = (session_id, turn_id)
        self._listen_for_cancels()
        self._waiting.add(turn)
        try:
            # A resubmitted chord keeps task ids and keys: stored results return without running again.
            body_id = self._dispatch_patiently(record)
        except OperationalError as exc:
            # The broker stayed unreachable until the deadline: no call may start later, each gets
            # its truthful result (NOT_EXECUTED unless part of the chord got out and started).
            log.warning("turn %s: the broker was unreachable: %s", turn_id, exc)
            return self._finish(record, None, "the broker could not be reached before the turn's deadline")
        except BaseException:
            self._waiting.discard(turn)
            raise
        if body_id is None:
            return self._finish(record, [], "")
        return record, body_id

    def _listen_for_cancels(self) -> None:
        """Start hearing other processes' cancel announcements (once; distributed mode only)."""
        if self._listening or self.runtime.redis is None:
            return
        try:
            listen_for_cancels(self.runtime.redis, self)
        except StoreUnavailable as exc:
            # Remote cancels are then seen through the flag poll alone; the next turn retries.
            log.warning("cannot listen for turn cancels yet: %s", exc)
        else:
            self._listening = True

    def heard_cancel(self, session_id: str, turn_id: str) -> None:
        """Another process cancelled a turn (called from the cancel listener's thread)."""
        if (session_id, turn_id) in self._waiting:
            self._cancelled_here.add((session_id, turn_id))

    @staticmethod
    def _wait_slice(record: TurnRecord, most: float) -> float:
        """How long the next wait may last: up to `most`, never past the deadline.

        Never zero: Celery reads a zero timeout as "wait forever".
        """
        return min(max(record.deadline - time.time(), 0.001), most)

    def _stop_reason(self, record: TurnRecord, ask_redis: bool) -> str | None:
        """Why waiting for this turn must end now, or None to keep waiting."""
        turn = (record.session_id, record.turn_id)
        if turn in self._cancelled_here or (ask_redis and self.turns.cancelled(*turn)):
            return "the turn was cancelled"
        if record.deadline <= time.time():
            return f"the turn's {round(record.deadline - record.started_at, 1):g} s deadline passed"
        return None

    def _all_stored(self, record: TurnRecord) -> bool:
        """Whether every dispatched call has a result in the idempotency store (False if unreachable)."""
        try:
            return all(raw is not None for raw in self._stored_results([dc.key for dc in record.dispatched]))
        except StoreUnavailable as exc:
            log.warning("reading turn %s's results: %s", record.turn_id, exc)
            return False

    def _callback_failed(self, record: TurnRecord, status: str | None) -> None:
        # A failed callback (a chord part lost to a Redis outage) is no news about the calls: they
        # may have finished and stored their results, or be about to. The turn keeps to its
        # deadline, now waiting on the idempotency store, instead of synthesizing early.
        log.warning("the callback of turn %s ended %s; waiting for its calls' stored results", record.turn_id, status)

    @observed_turn
    def run_calls(
        self, session_id: str, calls: list[ToolCall], *, turn_id: str | None = None, provider: Provider = "chat"
    ) -> TurnResult:
        """Run already-parsed calls as one turn and wait (blocking) for exactly one result each."""
        started = self._start(session_id, calls, provider, turn_id)
        if isinstance(started, TurnResult):
            return started
        record, body_id = started
        async_result = self.app.AsyncResult(body_id)
        remote_check = _RemoteCancelClock()
        callback_failed = False
        while True:
            if callback_failed:
                if self._all_stored(record):
                    return self._finish(record, None, "")
                time.sleep(self._wait_slice(record, _CANCEL_POLL))
            else:
                try:
                    value = async_result.get(
                        timeout=self._wait_slice(record, _CANCEL_POLL),
                        interval=0.002,
                        propagate=False,
                        disable_sync_subtasks=False,
                    )
                except CeleryTimeoutError:
                    pass
                except (redis.RedisError, OSError, RuntimeError) as exc:
                    # The result backend is unreachable (or Celery's consumer gave up): keep to the
                    # deadline, then the idempotency store supplies what finished.
                    log.warning("waiting for turn %s: %s", record.turn_id, exc)
                    time.sleep(_CANCEL_POLL)
                else:
                    if async_result.status == states.SUCCESS:
                        return self._finish(record, with_lost_results(value, record.dispatched), "")
                    self._callback_failed(record, async_result.status)
                    callback_failed = True
            ask_redis = remote_check.due()
            if ask_redis and not callback_failed and self._all_stored(record):
                return self._finish(record, None, "")
            if (reason := self._stop_reason(record, ask_redis)) is not None:
                return self._finish(record, None, reason)

    def run_turn(
        self, session_id: str, assistant_output: Any, provider: Provider = "chat", *, turn_id: str | None = None
    ) -> TurnResult:
        """Parse the model's assistant output for `provider` and run its tool calls as one turn."""
        calls = get_adapter(provider).parse_calls(assistant_output)
        return self.run_calls(session_id, calls, turn_id=turn_id, provider=provider)

    def _waiter(self) -> ResultWaiter:
        loop = asyncio.get_running_loop()
        waiter = self._waiters.get(loop)
        if waiter is None:
            backend_url = self.runtime.settings.result_backend
            waiter = (
                RedisResultWaiter(backend_url)
                if backend_url and backend_url.split("://", 1)[0] in ("redis", "rediss")
                else PollingResultWaiter(self.app)
            )
            self._waiters[loop] = waiter
        return waiter

    @observed_turn
    async def arun_calls(
        self, session_id: str, calls: list[ToolCall], *, turn_id: str | None = None, provider: Provider = "chat"
    ) -> TurnResult:
        """Async twin of `run_calls`: waits on the event loop, no thread per waiting turn."""
        started = self._start(session_id, calls, provider, turn_id)
        if isinstance(started, TurnResult):
            return started
        record, body_id = started
        try:
            return await self._await_turn(record, body_id)
        except asyncio.CancelledError:
            # The caller stopped waiting (the turn goes on: `resume` or a retry with the same ids
            # finds it); this process keeps no trace of it.
            self._stop_watching(record)
            raise

    async def _await_turn(self, record: TurnRecord, body_id: str) -> TurnResult:
        waiter = self._waiter()
        remote_check = _RemoteCancelClock()
        callback_failed = False
        while True:
            if callback_failed:
                if self._all_stored(record):
                    return self._finish(record, None, "")
                await asyncio.sleep(self._wait_slice(record, _CANCEL_POLL))
            else:
                meta = await waiter.wait(body_id, self._wait_slice(record, _CANCEL_POLL * 4))
                if meta is not None:
                    if meta.get("status") == states.SUCCESS:
                        return self._finish(record, with_lost_results(meta.get("result"), record.dispatched), "")
                    self._callback_failed(record, meta.get("status"))
                    callback_failed = True
            ask_redis = remote_check.due()
            if ask_redis and not callback_failed and self._all_stored(record):
                return self._finish(record, None, "")
            if (reason := self._stop_reason(record, ask_redis)) is not None:
                return self._finish(record, None, reason)

    async def arun_turn(
        self, session_id: str, assistant_output: Any, provider: Provider = "chat", *, turn_id: str | None = None
    ) -> TurnResult:
        """Async twin of `run_turn`."""
        calls = get_adapter(provider).parse_calls(assistant_output)
        return await self.arun_calls(session_id, calls, turn_id=turn_id, provider=provider)

    def resume(self, session_id: str) -> TurnResult | None:
        """Finish the session's unfinished turn after a restart (None when there is none).

        Resubmits the same chord: calls whose results are stored return them without running,
        live ones are waited for, and nothing that already ran runs again.
        """
        record = self.turns.active(session_id)
        if record is None:
            return None
        return self.run_calls(session_id, record.calls, turn_id=record.turn_id, provider=record.provider)

    def approve(self, session_id: str, call_id: str, *, by: str, note: str | None = None) -> Approval:
        """Approve a call waiting for a decision (from any process on the same Redis) and send it.

        At most once: approving twice, approving a decided call, or approving from two processes
        at once sends it once (and the worker's claim runs it once). See docs/approvals.md.
        """
        return self.approvals.approve(session_id, call_id, by=by, note=note)

    def deny(self, session_id: str, call_id: str, *, by: str, note: str | None = None) -> Approval:
        """Deny a call waiting for a decision: the model gets PERMISSION_DENIED with `note` as the reason."""
        return self.approvals.deny(session_id, call_id, by=by, note=note)

    def pending_approvals(self, session_id: str | None = None) -> list[Approval]:
        """Calls waiting for a decision (of one session, or all); overdue ones are expired on the way."""
        return self.approvals.pending(session_id)

    def cancel(self, session_id: str, turn_id: str) -> None:
        """Stop a turn: its waiting `run_*` returns promptly; unstarted calls will not start.

        A turn waited on by any orchestrator process stops within a wait slice (a quarter second
        for `run_*`, a second for `arun_*`): the flag is set in Redis and announced on the cancel
        channel. Should the announcement be lost, the waiting process reads the flag within 5 s.
        """
        self._cancelled_here.add((session_id, turn_id))
        self.turns.cancel(session_id, turn_id)
        if self.runtime.redis is not None:
            announce_cancel(self.runtime.redis, session_id, turn_id)
        record = self.turns.record(session_id, turn_id)
        if record is not None:
            for dc in record.dispatched:
                self.runtime.store.cancel(cancel_scope(turn_id, dc.key), self.runtime.settings.result_ttl)

    async def aclose(self) -> None:
        """Release this event loop's result waiter (call from the loop that ran `arun_*`)."""
        waiter = self._waiters.pop(asyncio.get_running_loop(), None)
        if waiter is not None:
            await waiter.close()

    def close(self) -> None:
        """Release connections held by this orchestrator (waiters of loops that are not running)."""
        for loop, waiter in list(self._waiters.items()):
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(waiter.close())
        self._waiters.clear()

