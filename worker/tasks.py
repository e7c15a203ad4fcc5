"""The Celery tasks: one per side-effect class to run a call, and the chord callback that collects.

Header tasks never raise (docs/architecture.md, "Celery behaviour"): every failure, including a bug in toolchord
itself, becomes a ToolResult, so one failing call never fails the chord. The only exception that
leaves a task is Celery's own `Retry`, which keeps the task id and its place in the chord.
Each call task returns a list of result dicts: its own appended to what the previous task in a
resource chain returned, so the callback can flatten chains and single calls alike.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from celery import Celery, Task
from celery.exceptions import Retry
from pydantic import ValidationError

import toolchord.worker.errors as errors
from toolchord.worker.admission import WaitForLimit, admitted
from toolchord.worker.context import ToolContext
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.handler_deadline import stop_at_timeout
from toolchord.worker.idempotency import Claim, ClaimState, ReplicationLagError
from toolchord.worker.models import ErrorCode, SideEffect, ToolCall, ToolResult
from toolchord.worker.payloads import CallPayload
from toolchord.worker.policy import SIDE_EFFECT_POLICIES, policy_of
from toolchord.worker.results import result_from_outcome
from toolchord.worker.retry_sending import give_up_at, publish_retry
from toolchord.worker.runner import run_handler, unavailable_tool_result
from toolchord.worker.spill import SessionSpill
from toolchord.worker.store_errors import StoreUnavailable
from toolchord.worker.tools import ToolSpec
from toolchord.worker.worker_runtime import WorkerRuntime, runtime_of

log = logging.getLogger("toolchord.worker")

TASK_NAMES: dict[SideEffect, str] = {name: policy.task_name for name, policy in SIDE_EFFECT_POLICIES.items()}
COLLECT_TASK = "toolchord.collect"

# Poll interval while another delivery of the same key holds a live claim.
_BUSY_POLL = 0.05
# Retry backoff stays far below the broker's visibility timeout (docs/architecture.md, "Celery behaviour").
_MAX_BACKOFF = 30.0
# Longest pause between attempts to store a result while Redis is unreachable.
_STORE_RETRY_MAX_DELAY = 1.0
# How long a delivery keeps trying to reach the idempotency store for its first step (a Redis
# restart): Celery's own retry would publish to the broker, often that same Redis, and a publish that
# fails drops the message. Well below the 10 s the hard time limit leaves over the tool's timeout, so
# the handler keeps its whole timeout afterwards.
_CLAIM_PATIENCE = 5.0
_RAN_ELSEWHERE = "the turn's deadline passed while another delivery of this call ran it"


def backoff_seconds(retries: int, visibility_timeout: int) -> float:
    """Exponential backoff with full jitter, capped well below the visibility timeout."""
    cap = min(_MAX_BACKOFF, visibility_timeout / 4)
    return random.uniform(0, min(cap, 0.2 * 2**retries))


class DispatchedLike(Protocol):
    """A call the orchestrator sent to the workers (toolchord.orchestrator.turn.DispatchedCall)."""

    @property
    def call(self) -> ToolCall: ...

    @property
    def side_effect(self) -> SideEffect: ...


class _Retry(Exception):
    """Internal: the attempt should be retried after `countdown` seconds (nothing ran, or it is safe).

    `unsent` gives the call's result when the retry cannot be sent (the broker stayed unreachable,
    worker/retry_sending.py): the answer the attempt would have had without retries left.
    """

    def __init__(self, countdown: float, reason: str, unsent: Callable[[], ToolResult]) -> None:
        super().__init__(reason)
        self.countdown = countdown
        self.unsent = unsent


class CallExecution:
    """One delivery of one call on a worker: claim, run, decide retry, store, return."""

    def __init__(
        self,
        runtime: WorkerRuntime,
        payload: CallPayload,
        attempt: int,
        may_retry: bool,
        *,
        unknown_before: str | None = None,
    ) -> None:
        self.rt = runtime
        self.p = payload
        self.call: ToolCall = payload.call
        self.attempt = attempt
        self.may_retry = may_retry
        # The id of an earlier call in this call's resource chain whose outcome is unknown.
        self.unknown_before = unknown_before
        self.spec: ToolSpec | None = runtime.registry.get(payload.call.name)

    @property
    def replicas(self) -> int:
        """Replicas this call's claim and result must reach: a failover must not forget an unsafe call that ran."""
        if self.spec is None or policy_of(self.spec.side_effect).repeatable:
            return 0
        return self.rt.settings.min_replicas

    @property
    def ttl(self) -> int:
        if self.spec is not None and self.spec.idempotency_key is not None:
            return int(self.spec.idempotency_window)
        return self.rt.settings.result_ttl

    def run(self) -> ToolResult:
        """The call's result.

        The tool's limits admit the call before anything else (its claim included): over a limit it
        waits in the broker (WaitForLimit), or is refused when it cannot start before the deadline.
        """
        if self.spec is None:
            return self._run()
        rt = self.rt
        with admitted(rt.limiter, rt.lease_renewer, self.spec, self.p, rt.settings.visibility_timeout) as refusal:
            return self._run() if refusal is None else self._never_run(refusal.reason)

    def _run(self) -> ToolResult:
        spec = self.spec
        if spec is None:
            return unavailable_tool_result(self.call, self.rt.registry.closest(self.call.name))
        if self.unknown_before is not None:
            # The chain exists to keep these calls in order on one resource: whatever state the
            # earlier call left it in is unknown, so running this one could act on the wrong state.
            return self._never_run(
                f"it runs after call {self.unknown_before} on the same resource, and that call's outcome is unknown"
            )
        store = self.rt.store
        if time.time() > self.p.deadline:
            return self._never_run("the turn's deadline passed before it started")
        token = uuid.uuid4().hex
        try:
            claim = self._claim_or_wait(token)
        except StoreUnavailable as exc:
            # Nothing ran yet, so a retry is safe for every class.
            countdown = backoff_seconds(self.attempt - 1, self.rt.settings.visibility_timeout)
            unclaimed = self._unclaimed(exc)
            if self.may_retry and time.time() + countdown < self.p.deadline:
                raise _Retry(countdown, f"idempotency store unreachable: {exc}", lambda: unclaimed) from exc
            return unclaimed
        if claim.state is ClaimState.STORED:
            assert claim.result_json is not None
            return self._for_this_call(claim.result_json)
        if claim.state is ClaimState.CANCELLED:
            return self._not_executed("the turn was cancelled or gave up on it before it started")
        if claim.state is ClaimState.RECLAIMED and not policy_of(spec.side_effect).repeatable:
            reconciled = self._reconcile(spec)
            if reconciled is not None:
                # Nobody saw how the earlier attempt ended: if it comes back after all, its real
                # result replaces this OUTCOME_UNKNOWN (and reaches the model as a late result).
                unknown = reconciled.error is not None and reconciled.error.code == ErrorCode.OUTCOME_UNKNOWN
                return self._store(token, reconciled, provisional=unknown)
        outcome = self._run_handler(spec, token)
        spill = SessionSpill(self.rt.spill, self.p.session_id)
        result = result_from_outcome(
            self.call, spec, outcome, attempts=self.attempt, spill=spill,
            max_data_bytes=self.rt.settings.max_result_data_bytes,
        )
        retry_in = self._retry_countdown(spec, outcome)
        if retry_in is not None:
            forget = not outcome.started or policy_of(spec.side_effect).repeatable
            store.release(self.p.key, token, forget_start=forget)
            raise _Retry(retry_in, f"{outcome.status}: {outcome.error_type}", lambda: self._store(token, result))
        return self._store(token, result)

    def _unclaimed(self, exc: StoreUnavailable) -> ToolResult:
        """NOT_EXECUTED for a call whose claim could not be taken (nothing ran)."""
        if isinstance(exc, ReplicationLagError):
            return self._not_executed(f"its claim could not be replicated ({exc})")
        return self._not_executed(f"the idempotency store was unreachable ({type(exc).__name__})")

    def _claim_or_wait(self, token: str) -> Claim:
        """Claim the key; while another delivery holds a live claim, wait for its result or its lease."""
        lease = self.rt.settings.claim_lease
        while True:
            claim = self._patiently(lambda: self.rt.store.claim(self.p.key, token, lease, self.ttl, self.p.cancel_scope,
                                                                replicas=self.replicas))
            if claim.state is not ClaimState.BUSY:
                return claim
            if time.time() > self.p.deadline:
                # That delivery started the call: it may have acted, so this is no NOT_EXECUTED.
                return Claim(state=ClaimState.STORED, result_json=self._unobserved(_RAN_ELSEWHERE).model_dump_json())
            time.sleep(_BUSY_POLL)

    def _patiently(self, step: Callable[[], Claim]) -> Claim:
        """`step` retried with backoff while Redis is unreachable, for up to _CLAIM_PATIENCE (never past
        the deadline); the last StoreUnavailable is raised."""
        give_up = time.monotonic() + min(_CLAIM_PATIENCE, self.p.deadline - time.time())
        delay = 0.05
        while True:
            try:
                return step()
            except StoreUnavailable as exc:
                if time.monotonic() + delay > give_up:
                    raise
                log.warning("idempotency store unreachable before call %s started (%s); trying again", self.call.id, exc)
                time.sleep(delay)
                delay = min(delay * 2, _STORE_RETRY_MAX_DELAY)

    def _never_run(self, reason: str) -> ToolResult:
        """NOT_EXECUTED, once the call can no longer start: settled in one atomic step (its cancel flag
        set unless it started). A call that another delivery started gets its result, or the answer
        for a started call nobody saw end."""
        scope = self.p.cancel_scope
        try:
            settled = self._patiently(lambda: self.rt.store.settle(self.p.key, scope, self.rt.settings.result_ttl))
        except StoreUnavailable as exc:
            # The orchestrator settles every NOT_EXECUTED it reports again before the turn ends.
            log.warning("could not settle call %s as not executed: %s", self.call.id, exc)
            return self._not_executed(reason)
        while settled.state is ClaimState.STARTED and time.time() < self.p.deadline:
            time.sleep(_BUSY_POLL)
            settled = self._patiently(lambda: self.rt.store.settle(self.p.key, scope, self.rt.settings.result_ttl))
        if settled.state is ClaimState.CANCELLED:
            return self._not_executed(reason)
        if settled.result_json is not None:
            return self._for_this_call(settled.result_json)
        return self._unobserved(_RAN_ELSEWHERE)

    def _unobserved(self, reason: str) -> ToolResult:
        """The result of a call that started and was not seen to end, as its side-effect class says."""
        spec_class = self.spec.side_effect if self.spec is not None else None
        error = (
            errors.outcome_unknown(self.call, reason)
            if policy_of(spec_class).unobserved_is_unknown
            else errors.turn_stopped_waiting(self.call, reason)
        )
        return errors.error_result(self.call, error, attempts=self.attempt)

    def _reconcile(self, spec: ToolSpec) -> ToolResult | None:
        """For an unsafe call whose earlier attempt was lost: a result, or None to run it again."""
        decision: bool | None = None
        if spec.reconcile is not None:
            try:
                decision = spec.reconcile(self.p.arguments, self._context())
            except Exception as exc:  # noqa: BLE001 - a failing check means we still do not know
                log.warning("reconcile for %s failed: %r", spec.name, exc)
        if decision is False:
            return None
        if decision is True:
            return ToolResult(
                call_id=self.call.id,
                name=self.call.name,
                status="ok",
                content="An earlier attempt of this call was interrupted, and the tool's reconcile check "
                "confirmed that it took effect; it was not run again.",
                attempts=self.attempt,
            )
        return errors.error_result(
            self.call,
            errors.outcome_unknown(self.call, "the worker running it was lost"),
            attempts=self.attempt,
        )

    def _context(self, workdir: str | None = None) -> ToolContext:
        store, scope = self.rt.store, self.p.cancel_scope
        return ToolContext(
            call_id=self.call.id,
            session_id=self.p.session_id,
            tool_name=self.call.name,
            idempotency_key=self.p.key,
            deadline=self.p.deadline,
            attempt=self.attempt,
            workdir=workdir,
        ).bind_cancel_check(lambda: store.cancelled(scope))

    def _run_handler(self, spec: ToolSpec, token: str) -> HandlerOutcome:
        # An in-process handler is stopped at its timeout by a timer around its run alone
        # (worker/handler_deadline.py); an isolated one by its sandbox.
        with self.rt.lease_renewer.hold(self.p.key, token):
            return stop_at_timeout(spec, lambda: run_handler(
                spec, self.p.arguments, self._context(),
                sandbox_uid=self.rt.settings.sandbox_uid,
                direct_fork=self.rt.settings.sandbox_direct_fork,
            ))

    def _retry_countdown(self, spec: ToolSpec, outcome: HandlerOutcome) -> float | None:
        """Seconds until the next attempt, or None when this outcome is final (docs/tools.md, "Side-effect classes")."""
        if not self.may_retry:
            return None
        if outcome.status == "error" and outcome.transient:
            retry = policy_of(spec.side_effect).repeatable or not outcome.started
        elif outcome.status == "timeout":
            retry = policy_of(spec.side_effect).repeatable and self.attempt == 1
        else:
            retry = False
        if not retry:
            return None
        countdown = backoff_seconds(self.attempt - 1, self.rt.settings.visibility_timeout)
        if time.time() + countdown + spec.timeout > self.p.deadline:
            return None
        return countdown

    def _store(self, token: str, result: ToolResult, *, provisional: bool = False) -> ToolResult:
        result_json = result.model_dump_json()
        # Bookkeeping about this result (the call timeline's "done" record) rides in the same round trip.
        self.rt.pending_writes.result_ready(result)
        # Keep trying through a Redis restart or failover, and until an unsafe call's result is on
        # enough replicas (settings.result_store_patience): the stored result is what this turn and
        # later ones report, so giving up at once would turn a finished call into OUTCOME_UNKNOWN or
        # TIMEOUT. The task's hard time limit (the tool's timeout + 10 s from the task's start) may
        # end the wait sooner.
        give_up = time.monotonic() + self.rt.settings.result_store_patience
        delay = 0.05
        while True:
            try:
                stored = self.rt.store.complete(self.p.key, token, result_json, self.ttl, provisional=provisional,
                                                replicas=self.replicas)
                break
            except StoreUnavailable as exc:
                if time.monotonic() + delay > give_up:
                    # The handler already ran: hand its result back through the chord even if it
                    # cannot be stored.
                    log.warning("could not store the result of call %s (%s); returning it unstored", self.call.id, exc)
                    return result
                log.warning("storing the result of call %s: %s; trying again", self.call.id, exc)
                time.sleep(delay)
                delay = min(delay * 2, _STORE_RETRY_MAX_DELAY)
        # Usually ours; another delivery's (or another call's, with a business key) if it stored first.
        return result if stored == result_json else self._for_this_call(stored)

    def _for_this_call(self, stored_json: str) -> ToolResult:
        """A stored result, re-addressed to this call: a business key may have stored another call's."""
        return ToolResult.model_validate_json(stored_json).model_copy(update={"call_id": self.call.id})

    def _not_executed(self, reason: str) -> ToolResult:
        return errors.error_result(self.call, errors.not_executed(self.call, reason), attempts=self.attempt)


def unknown_outcome_in(previous: list[dict[str, Any]]) -> str | None:
    """The id of the first call before this one in its resource chain whose outcome is unknown."""
    for item in previous:
        error = item.get("error") if isinstance(item, dict) else None
        if isinstance(error, dict) and error.get("code") == ErrorCode.OUTCOME_UNKNOWN.value:
            return str(item.get("call_id"))
    return None


def _internal_error(payload: dict[str, Any], exc: BaseException) -> ToolResult:
    """A bug in toolchord must not break the chord: report it as this call's result."""
    call_data = payload.get("call") if isinstance(payload, dict) else None
    try:
        call = ToolCall.model_validate(call_data)
    except ValidationError:
        call = ToolCall(id="unknown", name="unknown", arguments_raw="")
    log.exception("toolchord internal error while running call %s", call.id)
    return errors.error_result(call, errors.execution_error(call, "ToolchordInternalError", repr(exc)))


def _make_call_task(app: Celery, side_effect: SideEffect) -> Task:
    @app.task(
        name=TASK_NAMES[side_effect],
        shared=False,
        bind=True,
        # All classes ack late and requeue on worker loss: the redelivery finds the claim and
        # either re-runs (read/idempotent) or reports OUTCOME_UNKNOWN (unsafe) without re-running.
        acks_late=True,
        reject_on_worker_lost=True,
        max_retries=None,
        typing=False,
        # Tool output stays out of worker logs and events (Flower): it may hold secrets or PII.
        resultrepr_maxsize=0,
    )
    def run_call(self: Task, prior: list[dict[str, Any]] | None = None, *, payload: dict[str, Any]) -> list[dict[str, Any]]:
        # The task's hard time limit counts from about now: a retry waiting for the broker ends before it.
        began = time.monotonic()
        previous = list(prior or [])
        try:
            parsed = CallPayload.model_validate(payload)
            runtime = runtime_of(self.app)
            spec = runtime.registry.get(parsed.call.name)
            retries_allowed = spec.max_retries if spec is not None else 0
            # Deliveries that only waited for a limit are no attempts (docs/flow-control.md).
            retries = self.request.retries - parsed.waits
            execution = CallExecution(
                runtime,
                parsed,
                retries + 1,
                retries < retries_allowed,
                unknown_before=unknown_outcome_in(previous),
            )
            try:
                result = execution.run()
            except _Retry as retry:
                result = _retry_or_answer(self, retry, give_up_at(self, began, parsed.deadline))
        except WaitForLimit as wait:
            # Back to the broker, recording the wait in the payload: no pool process waits. Celery's
            # plain retry: if the broker cannot take it the message is dropped, and the call, which
            # never started, is NOT_EXECUTED at the turn's deadline (worker/retry_sending.py).
            raise self.retry(countdown=wait.countdown, kwargs={"payload": wait.payload}, max_retries=None) from None
        except Retry:
            raise
        except Exception as exc:  # noqa: BLE001 - header tasks never raise
            result = _internal_error(payload, exc)
        return [*previous, result.model_dump(mode="json")]

    return run_call


def _retry_or_answer(task: Task, retry: _Retry, give_up: float) -> ToolResult:
    """Send the retry CallExecution decided (class policy, attempts, deadline) by raising Celery's
    Retry, which keeps the task id and the chord membership; when the broker stays unreachable
    until `give_up`, the call's result without the retry."""
    sent = publish_retry(task, give_up, countdown=retry.countdown, max_retries=None)
    if sent is not None:
        raise sent from None
    return retry.unsent()


def collect(results: list[Any]) -> list[dict[str, Any]]:
    """The header's results as one list, one per call id (the first seen wins).

    `results` is what the header returned: one list of result dicts per header element. The
    callback takes nothing else, so no header message grows with the turn's size; the
    orchestrator puts the results in the model's order (`with_lost_results`).
    """
    by_id: dict[str, dict[str, Any]] = {}
    for element in results or []:
        for item in element if isinstance(element, list) else [element]:
            if isinstance(item, dict) and "call_id" in item:
                by_id.setdefault(item["call_id"], item)
    return list(by_id.values())


def with_lost_results(collected: list[Any] | None, dispatched: Sequence[DispatchedLike]) -> list[dict[str, Any]]:
    """`collected` plus a synthesized result for each dispatched call the callback had none for."""
    items = [item for item in collected or [] if isinstance(item, dict) and "call_id" in item]
    found = {item["call_id"] for item in items}
    for dc in dispatched:
        if dc.call.id in found:
            continue
        error = (
            errors.outcome_unknown(dc.call, "its result was lost")
            if policy_of(dc.side_effect).unobserved_is_unknown
            else errors.execution_error(dc.call, "ResultLost", "the worker returned no result for this call")
        )
        items.append(errors.error_result(dc.call, error).model_dump(mode="json"))
    return items


def register_tasks(app: Celery) -> None:
    """Register toolchord's tasks on an app made by `create_app`."""
    for side_effect in TASK_NAMES:
        _make_call_task(app, side_effect)
    # The callback is a pure function of its input: a redelivery after a lost worker is harmless,
    # while an early ack would lose the turn's callback with the worker.
    app.task(
        name=COLLECT_TASK, typing=False, shared=False, resultrepr_maxsize=0, acks_late=True, reject_on_worker_lost=True
    )(collect)


__all__ = [
    "COLLECT_TASK",
    "TASK_NAMES",
    "CallExecution",
    "backoff_seconds",
    "collect",
    "register_tasks",
    "unknown_outcome_in",
    "with_lost_results",
]
