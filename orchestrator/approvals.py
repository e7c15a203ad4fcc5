"""Calls that wait for a person's decision (docs/approvals.md).

A tool's `approval` policy (`"never"`, `"always"` or a function of the arguments) decides at
planning time whether a call may run. A call that needs approval is not dispatched: the turn
records it (`approval_store`) and ends with the call listed in `TurnResult.awaiting_approval`.
Any process on the same Redis may then `approve` or `deny` it; the state moves once, atomically,
and only the winning approver sends the call, as the Celery task it was planned as (same task id,
same idempotency key), so the worker's claim keeps it at most once even if it is sent twice.
`settle` gives the decided calls' results (waiting for approved calls to finish) so the session can
go on: `Agent.resume` appends them to the log and rebuilds the next request from it.
"""

from __future__ import annotations

import logging
import time

from pydantic import BaseModel, Field

from toolchord.orchestrator.approval_store import Approval, ApprovalStore, Decision
from toolchord.orchestrator.dispatch import CallDispatcher
from toolchord.orchestrator.event_stores import EventLog
from toolchord.orchestrator.events import ApprovalDecided, ApprovalRequested, Event
from toolchord.orchestrator.history_repair import History
from toolchord.orchestrator.recorder import stored_call
from toolchord.orchestrator.stores import OrchestratorStores
from toolchord.orchestrator.turn import TurnRecord
from toolchord.worker import errors
from toolchord.worker.models import ToolResult
from toolchord.worker.policy import policy_of
from toolchord.worker.redaction import redact
from toolchord.worker.tools import ToolSpec

log = logging.getLogger("toolchord.approvals")

# How often `settle` looks for an approved call's stored result.
_RESULT_POLL = 0.05
# Slack over the tool's own time (and its retry) for an approved call to come back.
_RUN_SLACK = 7.0


class UnknownApproval(LookupError):
    """No call of that id waits (or waited) for approval in that session."""


class SessionWaiting(RuntimeError):
    """The session has calls waiting for a decision: resume it once they are decided."""


def needs_approval(spec: ToolSpec, arguments: dict[str, object]) -> bool:
    """Whether the tool's policy holds this call for a decision; a policy function that raises holds it."""
    policy = spec.approval
    if policy == "never":
        return False
    if policy == "always":
        return True
    try:
        return bool(policy(dict(arguments)))
    except Exception:
        log.exception("approval policy of %s failed; the call waits for a decision", spec.name)
        return True


def turns_awaiting(events: list[Event], store: ApprovalStore | None = None,
                   session_id: str = "") -> dict[str, set[str]]:
    """Turns of a session log with calls that were held for a decision and have no result yet, and
    those calls' ids. The log's `approval_requested` events say which; with `store`, so do its records
    (a process that crashed before logging the request leaves only those)."""
    requested = {(e.turn_id, e.call_id) for e in events if isinstance(e, ApprovalRequested)}
    out: dict[str, set[str]] = {}
    for turn in History.from_events(events).turns:
        missing = {call.id for call in turn.missing()}
        if not missing:
            continue
        held = {call_id for call_id in missing if (turn.turn_id, call_id) in requested}
        if store is not None:
            held |= {a.call.id for a in store.for_turn(session_id, turn.turn_id)} & missing
        if held:
            out[turn.turn_id] = held
    return out


class Settlement(BaseModel):
    """What a turn's waiting calls have come to."""

    results: list[ToolResult] = Field(default_factory=list, description="Results of decided calls, model order.")
    decided: list[Approval] = Field(default_factory=list)
    waiting: list[Approval] = Field(default_factory=list, description="Calls still without a decision.")


def decision_result(approval: Approval) -> ToolResult:
    """The result the model gets for a denied or expired call (the same in every process)."""
    call = approval.call
    if approval.state == "DENIED":
        reason = f"{approval.decided_by} denied it" + (f": {approval.note}" if approval.note else "")
        return errors.error_result(call, errors.permission_denied(call, reason))
    seconds = approval.expires_at - approval.requested_at
    return errors.error_result(call, errors.not_executed(call, f"nobody approved it within {seconds:g} s"))


class ApprovalDesk:
    """Requests, decisions and settlements of an orchestrator's waiting calls (sent through its dispatcher)."""

    def __init__(self, dispatcher: CallDispatcher, stores: OrchestratorStores, event_log: EventLog | None = None) -> None:
        self.dispatcher = dispatcher
        self.runtime = dispatcher.runtime
        self.stores = stores
        self.store: ApprovalStore = stores.approvals
        self._log = event_log

    @property
    def log(self) -> EventLog:
        """Where decisions are written: the given log, else the configuration's (`Orchestrator.stores`)."""
        if self._log is None:
            self._log = self.stores.event_log
        return self._log

    # -- turn side ------------------------------------------------------------------------------

    def request(self, record: TurnRecord) -> None:
        """Record the turn's calls that wait for a decision (those recorded before are left as they are)."""
        if not record.awaiting:
            return
        now = time.time()
        approvals = []
        for dc in record.awaiting:
            spec = self.dispatcher.registry[dc.call.name]
            signature = self.dispatcher.signature(record, dc, first=True)
            approvals.append(Approval(
                session_id=record.session_id, turn_id=record.turn_id,
                call=stored_call(dc.call, spec.store_raw_arguments), tool=spec.name, side_effect=dc.side_effect,
                arguments=redact(spec.args_model.model_validate(dc.arguments).model_dump()),
                key=dc.key, task_id=dc.task_id,
                run_window=spec.timeout * policy_of(spec.side_effect).deadline_attempts + _RUN_SLACK,
                requested_at=now, expires_at=now + spec.approval_timeout, signature=dict(signature),
            ))
        self.store.open(approvals, self.runtime.settings.result_ttl)

    def awaiting(self, record: TurnRecord) -> list[Approval]:
        """The turn's waiting calls as recorded (a turn ends with these instead of their results),
        without their signatures: those carry the unredacted arguments."""
        if not record.awaiting:
            return []
        return [a.model_copy(update={"signature": None}) for a in self.store.for_turn(record.session_id, record.turn_id)]

    # -- decisions --------------------------------------------------------------------------------

    def _decide(self, session_id: str, call_id: str, decision: Decision, by: str, note: str | None) -> Approval:
        approval, changed = self.store.decide(session_id, call_id, decision, by, note, time.time())
        if approval is None:
            raise UnknownApproval(f"no call {call_id!r} waits for approval in session {session_id!r}")
        if changed:
            self.log.append(session_id, decided_event(approval))
            if approval.state == "APPROVED":
                self._send(approval)
        return approval

    def approve(self, session_id: str, call_id: str, *, by: str, note: str | None = None) -> Approval:
        """Approve a waiting call and send it to the workers. Returns the record as decided: a call
        decided before (or expired) keeps that decision and is not sent again."""
        return self._decide(session_id, call_id, "APPROVED", by, note)

    def deny(self, session_id: str, call_id: str, *, by: str, note: str | None = None) -> Approval:
        """Deny a waiting call: the model gets PERMISSION_DENIED with the note as the reason."""
        return self._decide(session_id, call_id, "DENIED", by, note)

    def pending(self, session_id: str | None = None) -> list[Approval]:
        """Calls waiting for a decision; those whose deadline passed are expired on the way."""
        now = time.time()
        out = []
        for approval in self.store.pending(session_id):
            if now >= approval.expires_at:
                self._decide(approval.session_id, approval.call.id, "EXPIRED", "toolchord", None)
            else:
                out.append(approval)
        return out

    def _send(self, approval: Approval) -> None:
        """Send the approved call as planned, with a fresh deadline for its run."""
        assert approval.signature is not None
        self.dispatcher.send_signature(approval.signature, approval.dispatch_deadline)
        self.store.mark_dispatched(approval.session_id, approval.call.id)

    # -- settling ---------------------------------------------------------------------------------

    def settle(self, session_id: str, turn_id: str) -> Settlement:
        """The results of the turn's decided calls, once none waits for a decision any more.

        Approved calls are waited for (up to their run window); an approved call whose send was
        lost (the approver died right after deciding) is sent again under the same task id and
        key, which the worker's claim makes harmless.
        """
        now = time.time()
        approvals = []
        for approval in self.store.for_turn(session_id, turn_id):
            if approval.state == "PENDING_APPROVAL" and now >= approval.expires_at:
                approval = self._decide(session_id, approval.call.id, "EXPIRED", "toolchord", None)
            approvals.append(approval)
        waiting = [a for a in approvals if a.state == "PENDING_APPROVAL"]
        if waiting:
            return Settlement(decided=[a for a in approvals if a not in waiting], waiting=waiting)
        for approval in approvals:
            if approval.state == "APPROVED" and not approval.dispatched:
                self._send(approval)
        ran = self._ran([a for a in approvals if a.state == "APPROVED"])
        results = [ran[a.call.id] if a.state == "APPROVED" else decision_result(a) for a in approvals]
        return Settlement(results=results, decided=approvals)

    def _ran(self, approved: list[Approval]) -> dict[str, ToolResult]:
        """The approved calls' results from the idempotency store; the truthful stand-in for any
        still missing at its run deadline (NOT_EXECUTED, OUTCOME_UNKNOWN, ...)."""
        found: dict[str, ToolResult] = {}
        store = self.runtime.store
        while True:
            missing = [a for a in approved if a.call.id not in found]
            for approval, raw in zip(missing, store.results([a.key for a in missing]), strict=True):
                if raw is not None:
                    found[approval.call.id] = ToolResult.model_validate_json(raw).model_copy(
                        update={"call_id": approval.call.id})
            missing = [a for a in approved if a.call.id not in found]
            overdue = [a for a in missing if a.dispatch_deadline <= time.time()]
            for approval in overdue:
                if time.time() > approval.dispatch_deadline + self.runtime.settings.result_ttl:
                    # Its result and start record may have expired: whether it ran is not known any more.
                    reason = "its records expired before the session was resumed"
                    found[approval.call.id] = errors.error_result(approval.call,
                                                                  errors.outcome_unknown(approval.call, reason))
                    continue
                reason = f"the approved call's {approval.run_window:g} s run window passed"
                # A result stored before the call was settled is the truth, not a stand-in.
                found[approval.call.id], _ = self.dispatcher.unanswered(
                    approval.call, turn_id=approval.turn_id, key=approval.key, task_id=approval.task_id,
                    side_effect=approval.side_effect, reason=reason)
            if len(found) == len(approved):
                return found
            time.sleep(_RESULT_POLL)


def decided_event(approval: Approval) -> ApprovalDecided:
    """The log event of a decision."""
    assert approval.decided_at is not None and approval.decided_by is not None
    decision = {"APPROVED": "approved", "DENIED": "denied"}.get(approval.state, "expired")
    return ApprovalDecided(turn_id=approval.turn_id, call_id=approval.call.id, tool=approval.tool,
                           decision=decision,
                           by=approval.decided_by, note=approval.note, decided_at=approval.decided_at)


__all__ = [
    "ApprovalDesk",
    "SessionWaiting",
    "Settlement",
    "UnknownApproval",
    "decided_event",
    "decision_result",
    "needs_approval",
    "turns_awaiting",
]
