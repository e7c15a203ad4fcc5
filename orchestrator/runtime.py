"""The orchestrator: one model turn → checks → a Celery chord → one result per call, in order.

A turn never hangs: it has a deadline, and calls without a result by then get `NOT_EXECUTED`
(never started, and now prevented from starting), `TIMEOUT` or `OUTCOME_UNKNOWN` (started; their
late results are kept and reported in the session's next turn).

The facade: planning is `planning.py`, sending and withdrawing calls `dispatch.py`, when a waiting
turn ends `turn_wait.py`; this module starts turns, finishes them into one result per call, and
carries cancels and approvals.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterable, Callable, Iterable
from pathlib import Path
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError

from toolchord.orchestrator.approval_store import Approval
from toolchord.orchestrator.approvals import ApprovalDesk
from toolchord.orchestrator.cancel_signals import announce_cancel, listen_for_cancels
from toolchord.orchestrator.dispatch import CallDispatcher, digest
from toolchord.orchestrator.event_stores import EventLog, JsonlEventLog
from toolchord.orchestrator.observability import observed_turn
from toolchord.orchestrator.pipeline import PermissionHook
from toolchord.orchestrator.planning import plan_turn
from toolchord.orchestrator.providers import get_adapter
from toolchord.orchestrator.stores import OrchestratorStores, stores_for
from toolchord.orchestrator.streaming import StreamingTurn, arun_stream, run_stream
from toolchord.orchestrator.turn import DispatchedCall, LateCall, TurnRecord, TurnResult
from toolchord.orchestrator.turn_store import TurnStore
from toolchord.orchestrator.turn_wait import ASYNC_SLICE, BLOCKING_SLICE, TurnWait, wait_async, wait_blocking
from toolchord.orchestrator.waiting import PollingResultWaiter, RedisResultWaiter, ResultWaiter
from toolchord.worker.celery_app import WorkerRuntime, create_app, runtime_of
from toolchord.worker.config import Settings
from toolchord.worker.models import ErrorCode, ToolCall, ToolResult
from toolchord.worker.observability.call_timeline import TIMELINE_DIR
from toolchord.worker.payloads import cancel_scope
from toolchord.worker.policy import policy_of
from toolchord.worker.registry import Provider, Registry
from toolchord.worker.store_errors import StoreUnavailable
from toolchord.worker.tools import PriorityClass

log = logging.getLogger("toolchord.orchestrator")


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
        # Builds, sends and withdraws the calls; the approval desk sends held calls through it too.
        self.dispatcher = CallDispatcher(self.app, self.registry)
        # Calls held for a decision; decisions are written to `event_log` (default: the configured log).
        self.approvals = ApprovalDesk(self.dispatcher, self.stores, event_log)
        self._waiters: dict[asyncio.AbstractEventLoop, ResultWaiter] = {}
        # Turns waited on here, and those of them known to be cancelled (by this orchestrator or
        # announced by another process): the waiting loops check the set at every slice.
        self._waiting: set[tuple[str, str]] = set()
        self._cancelled_here: set[tuple[str, str]] = set()
        self._listening = False
        if settings.embedded:
            self.runtime.registry.add_missing(registry)
            # Call timings beside the session logs, where `toolchord ui --log-dir` finds them.
            logs = event_log.directory if isinstance(event_log, JsonlEventLog) else Path(settings.log_dir)
            self.runtime.timeline_dir = logs / TIMELINE_DIR
            self.runtime.start_embedded_worker(self.app)

    # -- planning -----------------------------------------------------------------------------

    def plan(self, session_id: str, turn_id: str, calls: list[ToolCall], provider: Provider,
             sent: dict[str, DispatchedCall] | None = None, *,
             tenant: str | None = None, priority: PriorityClass | None = None) -> TurnRecord:
        """Check every call and group the valid ones: one chain per shared resource, in model order.

        Only the first `max_calls_per_turn` calls (model order) are checked and may run; each call
        past the cap gets a NOT_EXECUTED result without being read. `sent`: calls already sent
        while the message streamed (eager dispatch), kept as they were planned. `tenant` and
        `priority` override the orchestrator's defaults for this turn.
        """
        return plan_turn(session_id, turn_id, calls, provider, registry=self.registry, settings=self.runtime.settings,
                         permission_hook=self.permission_hook, turn_timeout=self.turn_timeout,
                         tenant=tenant if tenant is not None else self.tenant, priority=priority or self.priority,
                         sent=sent)

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
                    by_id[dc.call.id], was_stored = self.dispatcher.unanswered(
                        dc.call, turn_id=record.turn_id, key=dc.key, task_id=dc.task_id, side_effect=dc.side_effect,
                        reason=reason, not_run=found)
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

    def _open(
        self, session_id: str, calls: list[ToolCall], provider: Provider, turn_id: str | None, *,
        tenant: str | None = None, priority: PriorityClass | None = None,
    ) -> TurnResult | TurnRecord:
        """Plan and record the turn (or find it): a finished TurnResult, or the record to send."""
        turn_id = turn_id or digest(session_id, *(c.id for c in calls))
        found: TurnResult | TurnRecord | None
        if self.permission_hook is None:
            # Planning asks nobody outside this process: plan first, then look the turn up and record
            # the plan in one round trip (a resubmitted turn gets its first plan back).
            planned = self.plan(session_id, turn_id, calls, provider, tenant=tenant, priority=priority)
            found, late = self.turns.begin(planned)
        else:
            # The hook may ask a person: a resubmitted turn must not ask again, so look first.
            found, late = self.turns.find(session_id, turn_id)
            if found is None:
                found = self.plan(session_id, turn_id, calls, provider, tenant=tenant, priority=priority)
                self.turns.save(found)
        if isinstance(found, TurnResult):
            return found
        # Idempotent: a turn resumed after a crash between the two writes still records its held calls.
        self.approvals.request(found)
        found._late = tuple(late)
        return found

    def _send(self, record: TurnRecord, body_id: str) -> TurnResult | str:
        """Send the turn's chord with callback `body_id`: the callback id, or the TurnResult when
        nothing needed a worker or the broker stayed unreachable."""
        turn = (record.session_id, record.turn_id)
        self._listen_for_cancels()
        self._waiting.add(turn)
        try:
            # A resubmitted chord keeps task ids and keys: stored results return without running again.
            sent = self.dispatcher.send_turn_patiently(record, body_id)
        except OperationalError as exc:
            # The broker stayed unreachable until the deadline: no call may start later, each gets
            # its truthful result (NOT_EXECUTED unless part of the chord got out and started).
            log.warning("turn %s: the broker was unreachable: %s", record.turn_id, exc)
            return self._finish(record, None, "the broker could not be reached before the turn's deadline")
        except BaseException:
            self._waiting.discard(turn)
            raise
        if sent is None:
            return self._finish(record, [], "")
        return sent

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

    def _turn_wait(self, record: TurnRecord, callback_slice: float, has_callback: bool = True) -> TurnWait:
        turn = (record.session_id, record.turn_id)
        return TurnWait(
            record,
            callback_slice=callback_slice,
            cancelled=lambda: turn in self._cancelled_here,
            all_stored=lambda: self._all_stored(record),
            look=lambda: self._look(record),
            has_callback=has_callback,
        )

    # -- eager dispatch (orchestrator/streaming.py drives these) --------------------------------

    def watch(self, record: TurnRecord) -> None:
        """This process waits for the turn: it hears its cancels (a streamed turn, from its first call on)."""
        self._listen_for_cancels()
        self._waiting.add((record.session_id, record.turn_id))

    def unwatch(self, record: TurnRecord) -> None:
        """This process no longer waits for the turn (its message never completed)."""
        self._stop_watching(record)

    def start_streamed(self, record: TurnRecord, already_sent: set[str]) -> None:
        """Save a streamed turn's record and send the calls not sent while it streamed."""
        _, late = self.turns.begin(record)
        self.approvals.request(record)
        record._late = tuple(late)
        self.watch(record)
        self.dispatcher.send_groups(record, already_sent)

    def store_wait(self, record: TurnRecord, callback_slice: float) -> TurnWait:
        """The waiting decisions of a streamed turn: no chord callback, results from the idempotency store."""
        return self._turn_wait(record, callback_slice, has_callback=False)

    def finish_streamed(self, record: TurnRecord, reason: str) -> TurnResult:
        """One result per call of a streamed turn, read from the idempotency store."""
        return self._finish(record, None, reason)

    def streaming_turn(self, session_id: str, *, turn_id: str | None = None, provider: Provider = "chat",
                       scope: str | None = None, eager: bool = True,
                       on_sent: Callable[[ToolCall], None] | None = None, tenant: str | None = None,
                       priority: PriorityClass | None = None) -> StreamingTurn:
        """A turn fed call by call while the model streams (`add`, `end`, `wait`): calls that may
        start early start at once (docs/agent-loop.md, "Eager dispatch"). `scope` names the model
        request (its retry must give the same scope to reuse results); default: the turn id.
        `tenant` and `priority` override the orchestrator's defaults for this turn."""
        turn_id = turn_id or uuid.uuid4().hex
        return StreamingTurn(self, session_id, turn_id, provider, scope=scope or turn_id, eager=eager, on_sent=on_sent,
                             tenant=tenant, priority=priority)

    def run_stream(
        self, session_id: str, calls: Iterable[ToolCall], *, provider: Provider = "chat", turn_id: str | None = None,
        scope: str | None = None, eager: bool = True,
        message_complete: Callable[[list[ToolCall]], list[ToolCall] | None] | None = None,
        tenant: str | None = None, priority: PriorityClass | None = None,
    ) -> TurnResult | None:
        """Run calls as a stream completes them: each that may start early starts at once, the rest
        when the iterable ends; then wait (blocking) for one result per call. `message_complete(seen)`
        gives the message's final calls, or None when it did not complete cleanly: then nothing else
        starts and None is returned (the early calls' results stay stored by key for a retry).
        `tenant` and `priority` override the orchestrator's defaults for this turn."""
        turn = self.streaming_turn(session_id, turn_id=turn_id, provider=provider, scope=scope, eager=eager,
                                   tenant=tenant, priority=priority)
        return run_stream(turn, calls, message_complete)

    async def arun_stream(
        self, session_id: str, calls: AsyncIterable[ToolCall], *, provider: Provider = "chat",
        turn_id: str | None = None, scope: str | None = None, eager: bool = True,
        message_complete: Callable[[list[ToolCall]], list[ToolCall] | None] | None = None,
        tenant: str | None = None, priority: PriorityClass | None = None,
    ) -> TurnResult | None:
        """Async twin of `run_stream`."""
        turn = self.streaming_turn(session_id, turn_id=turn_id, provider=provider, scope=scope, eager=eager,
                                   tenant=tenant, priority=priority)
        return await arun_stream(turn, calls, message_complete)

    def _all_stored(self, record: TurnRecord) -> bool:
        """Whether every dispatched call has a result in the idempotency store (False if unreachable)."""
        try:
            return all(raw is not None for raw in self._stored_results([dc.key for dc in record.dispatched]))
        except StoreUnavailable as exc:
            log.warning("reading turn %s's results: %s", record.turn_id, exc)
            return False

    def _look(self, record: TurnRecord) -> tuple[bool, bool]:
        """The turn's cancel flag in Redis and whether every dispatched call has a stored result, in
        one round trip (False, False if unreachable: the turn keeps to its deadline)."""
        try:
            flagged, stored = self.turns.look(record.session_id, record.turn_id, [dc.key for dc in record.dispatched])
        except StoreUnavailable as exc:
            log.warning("looking at turn %s: %s", record.turn_id, exc)
            return False, False
        return flagged, all(raw is not None for raw in stored)

    @observed_turn
    def run_calls(
        self, session_id: str, calls: list[ToolCall], *, turn_id: str | None = None, provider: Provider = "chat",
        tenant: str | None = None, priority: PriorityClass | None = None,
    ) -> TurnResult:
        """Run already-parsed calls as one turn and wait (blocking) for exactly one result each.

        `tenant` and `priority` override the orchestrator's defaults for this turn (docs/flow-control.md).
        """
        record = self._open(session_id, calls, provider, turn_id, tenant=tenant, priority=priority)
        if isinstance(record, TurnResult):
            return record
        sent = self._send(record, self.dispatcher.callback_id(record))
        if isinstance(sent, TurnResult):
            return sent
        end = wait_blocking(self._turn_wait(record, BLOCKING_SLICE), self.app.AsyncResult(sent))
        return self._finish(record, end.collected, end.reason)

    def run_turn(
        self, session_id: str, assistant_output: Any, provider: Provider = "chat", *, turn_id: str | None = None,
        tenant: str | None = None, priority: PriorityClass | None = None,
    ) -> TurnResult:
        """Parse the model's assistant output for `provider` and run its tool calls as one turn."""
        calls = get_adapter(provider).parse_calls(assistant_output)
        return self.run_calls(session_id, calls, turn_id=turn_id, provider=provider, tenant=tenant, priority=priority)

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
        self, session_id: str, calls: list[ToolCall], *, turn_id: str | None = None, provider: Provider = "chat",
        tenant: str | None = None, priority: PriorityClass | None = None,
    ) -> TurnResult:
        """Async twin of `run_calls`: waits on the event loop, no thread per waiting turn."""
        record = self._open(session_id, calls, provider, turn_id, tenant=tenant, priority=priority)
        if isinstance(record, TurnResult):
            return record
        waiter, body_id = self._waiter(), self.dispatcher.callback_id(record)
        if record.dispatched:
            # Listening before the chord goes out: no result can come before the subscription, so
            # the first wait needs no look at the result key.
            await waiter.expect(body_id)
        sent = self._send(record, body_id)
        if isinstance(sent, TurnResult):
            return sent
        try:
            end = await wait_async(self._turn_wait(record, ASYNC_SLICE), waiter, sent)
        except asyncio.CancelledError:
            # The caller stopped waiting (the turn goes on: `resume` or a retry with the same ids
            # finds it); this process keeps no trace of it.
            self._stop_watching(record)
            raise
        return self._finish(record, end.collected, end.reason)

    async def arun_turn(
        self, session_id: str, assistant_output: Any, provider: Provider = "chat", *, turn_id: str | None = None,
        tenant: str | None = None, priority: PriorityClass | None = None,
    ) -> TurnResult:
        """Async twin of `run_turn`."""
        calls = get_adapter(provider).parse_calls(assistant_output)
        return await self.arun_calls(session_id, calls, turn_id=turn_id, provider=provider, tenant=tenant,
                                     priority=priority)

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

