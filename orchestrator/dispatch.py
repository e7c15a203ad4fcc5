"""Sending planned calls to the workers, and giving up on a call that has no result in time.

A planned call (`DispatchedCall`) goes out as one Celery signature: task id from its idempotency
key, the tool's queue and time limits, a `CallPayload` with the turn's deadline. A turn sends its
calls as one chord; the approval desk sends a held call later as the same signature. When a call has
no result by its deadline (the turn's, or an approved call's run window), `unanswered` gives the
truthful stand-in and makes sure the call does not start afterwards. Both the turn runtime and the
approval desk use this module, so neither needs the other.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from celery import Celery, chain, chord
from celery.backends.redis import RedisBackend
from celery.canvas import Signature
from kombu.exceptions import OperationalError

from toolchord.orchestrator.fair_share import call_priority
from toolchord.orchestrator.turn import DispatchedCall, TurnRecord
from toolchord.worker import errors
from toolchord.worker.celery_app import WorkerRuntime, runtime_of
from toolchord.worker.idempotency import ClaimState
from toolchord.worker.models import SideEffect, ToolCall, ToolResult
from toolchord.worker.payloads import CallPayload, cancel_scope
from toolchord.worker.policy import policy_of
from toolchord.worker.priorities import FIRST_STEP, broker_priority
from toolchord.worker.registry import Registry
from toolchord.worker.tasks import COLLECT_TASK, TASK_NAMES

log = logging.getLogger("toolchord.orchestrator")

# Slack over the tool's timeout for Celery's hard time limit, the last resort: the sandbox (or, for
# an in-process handler, its own timer) stops the handler at the timeout itself. No soft time
# limit: Celery raises it wherever the task is, its own chord bookkeeping included
# (docs/architecture.md, "Celery behaviour").
_HARD_LIMIT_SLACK = 10.0


def digest(*parts: str) -> str:
    """A stable id from its parts (turn ids, task ids): the same parts give the same id in every process."""
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def release_pending(backend: Any, task_ids: list[str]) -> None:
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


class CallDispatcher:
    """Turns planned calls into the Celery signatures they are sent as, sends them, and withdraws
    the ones left without a result."""

    def __init__(self, app: Celery, registry: Registry) -> None:
        self.app = app
        self.runtime: WorkerRuntime = runtime_of(app)
        self.registry = registry
        # Call tasks keep no per-task result where the chord does not need one: the Redis backend
        # joins a chord from its own list (on_chord_part_return runs whatever ignore_result says),
        # and the idempotency store keeps each result by key. A per-task copy would cost a GET and
        # a SET/PUBLISH per call on the worker and a result subscription per call here. Other
        # backends (the embedded cache) join by reading each task's result, so they keep it.
        self._ignore_call_results = isinstance(app.backend, RedisBackend)
        self._broker_kind = self.runtime.settings.broker_kind

    def signature(self, record: TurnRecord, dc: DispatchedCall, first: bool, rank: int = 0) -> Signature:
        """The Celery signature of one planned call of the turn (`first`: it starts its chain)."""
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
        return self.app.signature(
            TASK_NAMES[spec.side_effect],
            kwargs={"payload": payload.model_dump(mode="json")},
            immutable=first,
            task_id=dc.task_id,
            queue=self.runtime.queue(spec.queue),
            time_limit=spec.timeout + _HARD_LIMIT_SLACK,
            # Tool arguments stay out of events and Flower: show the tool and the call id only.
            argsrepr=f"{dc.call.name} call={dc.call.id}",
            kwargsrepr="{}",
            ignore_result=self._ignore_call_results,
            # Fair share (docs/flow-control.md): later calls of a large fan-out queue behind small turns.
            priority=broker_priority(call_priority(rank, record.priority, spec.priority), self._broker_kind),
        )

    @staticmethod
    def callback_id(record: TurnRecord) -> str:
        """A new task id for the turn's chord callback (each send of a resubmitted turn gets its own):
        known before the chord is sent, so a waiter can listen for it first."""
        return "tc-collect-" + digest(record.session_id, record.turn_id, str(time.time_ns()))

    def send_turn(self, record: TurnRecord, body_id: str) -> str | None:
        """Send the turn's chord with callback `body_id`; returns it (None when nothing needs a worker)."""
        if not record.dispatched:
            return None
        by_id = {dc.call.id: dc for dc in record.dispatched}
        rank = {dc.call.id: position for position, dc in enumerate(record.dispatched)}
        header = []
        for group in record.groups:
            sigs = [self.signature(record, by_id[cid], first=i == 0, rank=rank[cid]) for i, cid in enumerate(group)]
            header.append(sigs[0] if len(sigs) == 1 else chain(*sigs))
        # Every header message carries a copy of the body (docs/architecture.md, "Celery behaviour"), so
        # the body has no per-call arguments: the orchestrator orders the results from its own record.
        # The callback goes first: the turn's results are ready, and a worker busy with a fan-out's
        # tail would otherwise keep the turn waiting (a message without a priority is RabbitMQ's lowest).
        body = self.app.signature(COLLECT_TASK, task_id=body_id, queue=self.runtime.queue(),
                                  priority=broker_priority(FIRST_STEP, self._broker_kind))
        # chord() explicitly, never chain(group, body): a one-task group would unroll (same section).
        chord(header, body).apply_async()
        if self._ignore_call_results:
            release_pending(self.app.backend, [dc.task_id for dc in record.dispatched])
        return body_id

    def send_call(self, record: TurnRecord, dc: DispatchedCall) -> None:
        """Send one call on its own, before its turn is complete (eager dispatch: no chord waits for it)."""
        self.signature(record, dc, first=True).apply_async()

    def send_groups(self, record: TurnRecord, already_sent: set[str]) -> None:
        """Send each header element of the turn on its own (no chord), skipping calls already sent:
        the turn is collected from the idempotency store (`TurnWait(has_callback=False)`)."""
        by_id = {dc.call.id: dc for dc in record.dispatched}
        rank = {dc.call.id: position for position, dc in enumerate(record.dispatched)}
        for group in record.groups:
            todo = [cid for cid in group if cid not in already_sent]
            if not todo:
                continue
            sigs = [self.signature(record, by_id[cid], first=i == 0, rank=rank[cid]) for i, cid in enumerate(todo)]
            (sigs[0] if len(sigs) == 1 else chain(*sigs)).apply_async()

    def send_turn_patiently(self, record: TurnRecord, body_id: str) -> str | None:
        """`send_turn`, waiting up to the turn's deadline for a broker that cannot be reached (a
        restart, a failover); OperationalError when it still cannot be reached then."""
        try:
            return self.send_turn(record, body_id)
        except OperationalError as exc:
            log.warning("turn %s: the broker is unreachable (%s); waiting for it until the deadline", record.turn_id, exc)
        # Celery's publish retry cannot cover this: kombu connects a producer with the connection's
        # own options, not the publish's retry policy (kombu issues 735, 1024). Resending is safe: a
        # resubmitted chord keeps its task ids and keys (and its callback's, which the waiter listens for).
        with self.app.connection_for_write() as connection:
            connection.ensure_connection(
                timeout=max(record.deadline - time.time(), 0.001), interval_start=0, interval_step=0.5, interval_max=1
            )
        return self.send_turn(record, body_id)

    def send_signature(self, signature: dict[str, Any], deadline: float) -> None:
        """Send a call as the signature it was planned as (stored as a dict), with a new run deadline."""
        sig = self.app.signature(signature)
        sig.kwargs["payload"]["deadline"] = deadline
        sig.apply_async()

    def unanswered(
        self, call: ToolCall, *, turn_id: str, key: str, task_id: str, side_effect: SideEffect, reason: str,
        not_run: ToolResult | None = None,
    ) -> tuple[ToolResult, bool]:
        """The truthful result for a sent call that has none when its wait ends (or only `not_run`, a
        worker's NOT_EXECUTED), and whether it is the stored one; the call will not start later."""
        # One atomic step: a stored result is taken, a recorded start means the call began, and
        # otherwise the cancel flag is set, which every later claim refuses (no call is reported
        # NOT_EXECUTED and then run).
        settled = self.runtime.store.settle(key, cancel_scope(turn_id, key), self.runtime.settings.result_ttl)
        if settled.state is ClaimState.STORED and settled.result_json is not None:
            return ToolResult.model_validate_json(settled.result_json).model_copy(update={"call_id": call.id}), True
        if not_run is None:
            try:
                self.app.control.revoke(task_id)
            except OperationalError as exc:
                # Only a shortcut for workers: the settled key already keeps the call from starting.
                log.warning("could not revoke call %s: %s", call.id, exc)
        if settled.state is ClaimState.CANCELLED:
            return not_run or errors.error_result(call, errors.not_executed(call, reason)), False
        reason = reason or "the turn ended"
        if policy_of(side_effect).unobserved_is_unknown:
            error = errors.outcome_unknown(call, f"{reason} while it was running")
        elif reason.startswith("the turn was cancelled"):
            error = errors.cancelled(call)
        else:
            # The turn stopped waiting; the tool's own timeout did not stop the call.
            error = errors.turn_stopped_waiting(call, reason)
        return errors.error_result(call, error), False
