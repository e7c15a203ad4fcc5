"""The agent loop (**API**: `toolchord.Agent`).

model call → turn on the runtime (`Orchestrator.run_calls`) → next request rebuilt from the log,
until the model answers without tool calls or the step limit is reached. Every step is written to
the session's event log first, so a crashed conversation resumes from the log alone.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import BaseModel, Field

from toolchord.orchestrator.approval_store import Approval
from toolchord.orchestrator.approvals import SessionWaiting, decided_event, turns_awaiting
from toolchord.orchestrator.event_stores import EventLog
from toolchord.orchestrator.events import (
    ApprovalDecided,
    ApprovalRequested,
    CallSentEarly,
    Event,
    MessageEnded,
    ModelFailed,
    ModelOutput,
    ModelRequest,
    SessionStarted,
    ToolsDeclared,
    UserInput,
    declarations_from_registry,
    tools_digest,
)
from toolchord.orchestrator.model_clients import (
    ModelClient,
    ModelError,
    ModelReply,
    make_model_client,
)
from toolchord.orchestrator.providers import get_adapter
from toolchord.orchestrator.providers.plain_data import well_formed_output
from toolchord.orchestrator.recorder import SessionRecorder
from toolchord.orchestrator.request_builder import RequestBuilder, assistant_text, request_digest
from toolchord.orchestrator.session_lease import session_lease
from toolchord.orchestrator.stores import open_event_log
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import Provider, Registry
from toolchord.worker.tools import PriorityClass

if TYPE_CHECKING:
    from toolchord.orchestrator.runtime import Orchestrator
    from toolchord.orchestrator.streaming import StreamingTurn
    from toolchord.orchestrator.turn import TurnResult


class IncompleteMessage(RuntimeError):
    """A streamed message the model did not finish (the cause of its ModelError)."""


class AgentStep(BaseModel):
    """One model call of a run and what its tool calls returned."""

    step: int
    turn_id: str
    text: str
    calls: list[ToolCall] = Field(default_factory=list)
    results: list[ToolResult] = Field(default_factory=list)
    late_results: list[ToolResult] = Field(default_factory=list)


class AgentResult(BaseModel):
    """How a run ended: the final text (empty when the step limit stopped it or calls wait for a
    decision) and every step. `waiting_approval`: `awaiting_approval` lists the calls to decide;
    `Agent.resume` continues once they are decided."""

    session_id: str
    text: str
    stop_reason: Literal["final", "max_steps", "waiting_approval"]
    steps: list[AgentStep]
    awaiting_approval: list[Approval] = Field(default_factory=list)


class Agent:
    """Runs a conversation with a model whose tool calls execute on toolchord.

    `orchestrator=None` builds an embedded Orchestrator from `registry` (closed by `close`).
    `client` defaults to the official SDK for `provider` at `base_url`; model errors (rate limits,
    5xx) are retried by the SDK (`max_retries`) and then raise `ModelError`. `tenant` and
    `priority` set its turns' tenant and priority class over the orchestrator's (docs/flow-control.md).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        model: str,
        provider: Provider = "chat",
        orchestrator: Orchestrator | None = None,
        client: ModelClient | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        event_log: EventLog | None = None,
        system: str | None = None,
        max_steps: int = 16,
        stream: bool = False,
        eager: bool = True,
        max_retries: int = 2,
        request_options: dict[str, Any] | None = None,
        on_step: Callable[[AgentStep], None] | None = None,
        tenant: str | None = None,
        priority: PriorityClass | None = None,
    ) -> None:
        self.registry = registry
        self.model = model
        self.provider: Provider = provider
        self._own_orchestrator = orchestrator is None
        self.log: EventLog = event_log if event_log is not None else open_event_log()
        if orchestrator is None:
            from toolchord.orchestrator.runtime import Orchestrator

            orchestrator = Orchestrator(registry, event_log=self.log)
        self.orchestrator = orchestrator
        self.client: ModelClient = client or make_model_client(provider, base_url=base_url, api_key=api_key,
                                                               max_retries=max_retries)
        self.builder = RequestBuilder(self.log)
        self.system = system
        self.max_steps = max_steps
        self.stream = stream
        # Eager dispatch (docs/agent-loop.md): with a stream, calls that may start early start as
        # soon as their arguments are complete instead of after the whole message.
        self.eager = eager
        self.request_options = dict(request_options or {})
        self.on_step = on_step
        # This agent's turns' tenant and priority class (None: the orchestrator's defaults).
        self.tenant = tenant
        self.priority: PriorityClass | None = priority
        # Built once: every run declares the same tools (the orchestrator copied the registry too).
        self._declared = declarations_from_registry(registry)
        self._tools_digest = tools_digest(self._declared)

    # -- one step, split around the two waits (model, runtime) so run and arun share it --------

    def _begin(self, prompt: str, session_id: str) -> SessionRecorder:
        recorder = SessionRecorder(self.log, session_id, self.registry)
        events = self.log.read(session_id)
        if turns_awaiting(events, self.orchestrator.approvals.store, session_id):
            raise SessionWaiting(f"session {session_id} has calls waiting for a decision: decide them, then resume it")
        declared, digest = self._declared, self._tools_digest
        if not any(isinstance(e, SessionStarted) for e in events):
            recorder.append(SessionStarted(provider=self.provider, model=self.model, system=self.system,
                                           request_options=self.request_options))
        last_tools = next((e for e in reversed(events) if isinstance(e, ToolsDeclared)), None)
        if last_tools is None or last_tools.digest != digest:
            recorder.append(ToolsDeclared(tools=declared, digest=digest))
        recorder.user_input(prompt)
        return recorder

    def _request(self, recorder: SessionRecorder, step: int) -> dict[str, Any]:
        """The step's request, rebuilt from the log, with its `model_request` event written."""
        request = self.builder.build(recorder.session_id, self.provider, model=self.model)
        tools = next((e for e in reversed(self.log.read(recorder.session_id)) if isinstance(e, ToolsDeclared)), None)
        recorder.append(ModelRequest(provider=self.provider, model=self.model, step=step, stream=self.stream,
                                     tools_digest=tools.digest if tools else "", request_digest=request_digest(request)))
        return request

    def _failed(self, recorder: SessionRecorder, exc: ModelError) -> None:
        recorder.append(ModelFailed(provider=self.provider, model=self.model, error_type=type(exc.__cause__).__name__,
                                    message=str(exc)))

    def _record_output(self, recorder: SessionRecorder, reply: ModelReply,
                       turn_id: str | None = None) -> tuple[str, str, list[ToolCall]]:
        adapter = get_adapter(self.provider)
        calls = reply.calls if reply.calls is not None else adapter.parse_calls(reply.output)
        calls = sorted(calls, key=lambda call: call.index)  # streams hand calls out as they complete
        # Lone surrogates (a JSON escape like "\\ud800" a non-streamed reply decodes) cannot be logged or
        # sent: the calls above escaped them (INVALID_JSON), the output and items get them repaired.
        items = well_formed_output(adapter.assistant_items(reply.output))
        turn_id = turn_id or uuid.uuid4().hex
        recorder.model_output(self.provider, self.model, turn_id, well_formed_output(reply.output), items, calls)
        if calls:
            recorder.dispatched(turn_id, [call.id for call in calls])
        return turn_id, assistant_text(self.provider, items), calls

    def _record_turn(self, recorder: SessionRecorder, step: int, turn_id: str, text: str, calls: list[ToolCall],
                     turn: TurnResult | None) -> AgentStep:
        results = turn.results if turn is not None else []
        late = turn.late_results if turn is not None else []
        for result in results:
            recorder.result(turn_id, result)
        for result in late:
            recorder.result(turn_id, result, late=True)
        for approval in turn.awaiting_approval if turn is not None else []:
            recorder.append(ApprovalRequested(turn_id=turn_id, call_id=approval.call.id, tool=approval.tool,
                                              arguments=approval.arguments, expires_at=approval.expires_at))
        done = AgentStep(step=step, turn_id=turn_id, text=text, calls=calls, results=results, late_results=late)
        if self.on_step is not None:
            self.on_step(done)
        return done

    # -- eager dispatch: calls start while the model's message streams ---------------------------

    def _eager_now(self) -> bool:
        return self.stream and self.eager

    def _streaming_turn(self, recorder: SessionRecorder, request: dict[str, Any]) -> StreamingTurn:
        turn_id = uuid.uuid4().hex

        def sent(call: ToolCall) -> None:
            recorder.append(CallSentEarly(turn_id=turn_id, call_id=call.id, tool=call.name))

        # Scoped by the request's digest: a retry of this request (same log, same bytes) maps the
        # same calls to the same keys, so what already ran is reused.
        return self.orchestrator.streaming_turn(recorder.session_id, turn_id=turn_id, provider=self.provider,
                                                scope=request_digest(request), on_sent=sent, tenant=self.tenant,
                                                priority=self.priority)

    def _message_failed(self, recorder: SessionRecorder, streaming: StreamingTurn, exc: ModelError) -> None:
        """The stream broke: nothing else starts, its model output is never written (the calls
        sent early stay out of the history; their stored results serve a retry)."""
        streaming.end(None)
        recorder.append(MessageEnded(turn_id=streaming.turn_id, complete=False, reason=str(exc)))
        self._failed(recorder, exc)

    def _finished_message(self, request: dict[str, Any], reply: ModelReply) -> ModelReply:
        """The streamed reply when the model ended it cleanly; a message cut short (token limit,
        refusal, dropped connection) raises ModelError like a failed request: none of its `unsafe`
        calls ever started."""
        if not reply.ended_cleanly:
            raise ModelError(self.provider, str(request.get("model")),
                             IncompleteMessage("the streamed message ended before the model finished it"))
        return reply

    def _record_streamed(self, recorder: SessionRecorder, streaming: StreamingTurn,
                         reply: ModelReply) -> tuple[str, str, list[ToolCall]]:
        """Log the message's end and its output, then end the streaming turn with its final calls."""
        recorder.append(MessageEnded(turn_id=streaming.turn_id, complete=True))
        turn_id, text, calls = self._record_output(recorder, reply, streaming.turn_id)
        streaming.end(calls)
        return turn_id, text, calls

    # -- the loop -------------------------------------------------------------------------------

    def _stop(self, recorder: SessionRecorder, steps: list[AgentStep], turn: TurnResult | None) -> AgentResult | None:
        """The result when the step just taken ends the run (final answer, or calls held for a decision)."""
        if turn is not None and turn.waiting:
            return AgentResult(session_id=recorder.session_id, text="", stop_reason="waiting_approval", steps=steps,
                               awaiting_approval=turn.awaiting_approval)
        if not steps[-1].calls:
            return AgentResult(session_id=recorder.session_id, text=steps[-1].text, stop_reason="final", steps=steps)
        return None

    def _first_step(self, session_id: str) -> int:
        # Steps are numbered from the prompt on: a resumed run goes on counting (replay labels them).
        return _steps_taken(self.log.read(session_id)) + 1

    def _loop(self, recorder: SessionRecorder) -> AgentResult:
        steps: list[AgentStep] = []
        first = self._first_step(recorder.session_id)
        for step in range(first, first + self.max_steps):
            request = self._request(recorder, step)
            if self._eager_now():
                streaming = self._streaming_turn(recorder, request)
                try:
                    reply = self._finished_message(request, self.client.complete(
                        request, stream=True, on_call=streaming.add))
                except ModelError as exc:
                    self._message_failed(recorder, streaming, exc)
                    raise
                turn_id, text, calls = self._record_streamed(recorder, streaming, reply)
                turn = streaming.wait() if calls else None
                steps.append(self._record_turn(recorder, step, turn_id, text, calls, turn))
                if (done := self._stop(recorder, steps, turn)) is not None:
                    return done
                continue
            try:
                reply = self.client.complete(request, stream=self.stream)
            except ModelError as exc:
                self._failed(recorder, exc)
                raise
            turn_id, text, calls = self._record_output(recorder, reply)
            turn = (self.orchestrator.run_calls(recorder.session_id, calls, turn_id=turn_id, provider=self.provider,
                                                tenant=self.tenant, priority=self.priority)
                    if calls else None)
            steps.append(self._record_turn(recorder, step, turn_id, text, calls, turn))
            if (done := self._stop(recorder, steps, turn)) is not None:
                return done
        return AgentResult(session_id=recorder.session_id, text="", stop_reason="max_steps", steps=steps)

    async def _aloop(self, recorder: SessionRecorder) -> AgentResult:
        steps: list[AgentStep] = []
        first = self._first_step(recorder.session_id)
        for step in range(first, first + self.max_steps):
            request = self._request(recorder, step)
            if self._eager_now():
                streaming = self._streaming_turn(recorder, request)
                try:
                    reply = self._finished_message(request, await self.client.acomplete(
                        request, stream=True, on_call=streaming.add))
                except ModelError as exc:
                    self._message_failed(recorder, streaming, exc)
                    raise
                turn_id, text, calls = self._record_streamed(recorder, streaming, reply)
                turn = await streaming.await_() if calls else None
                steps.append(self._record_turn(recorder, step, turn_id, text, calls, turn))
                if (done := self._stop(recorder, steps, turn)) is not None:
                    return done
                continue
            try:
                reply = await self.client.acomplete(request, stream=self.stream)
            except ModelError as exc:
                self._failed(recorder, exc)
                raise
            turn_id, text, calls = self._record_output(recorder, reply)
            turn = (await self.orchestrator.arun_calls(recorder.session_id, calls, turn_id=turn_id,
                                                       provider=self.provider, tenant=self.tenant,
                                                       priority=self.priority)
                    if calls else None)
            steps.append(self._record_turn(recorder, step, turn_id, text, calls, turn))
            if (done := self._stop(recorder, steps, turn)) is not None:
                return done
        return AgentResult(session_id=recorder.session_id, text="", stop_reason="max_steps", steps=steps)

    def _settle(self, session_id: str) -> AgentResult | SessionRecorder:
        """Append the decided calls' results to the log (approved calls are waited for); the
        recorder to continue with, or the result when there is nothing to continue: `waiting_approval`
        while some calls are undecided, the final answer when the session already ended."""
        recorder = SessionRecorder(self.log, session_id, self.registry)
        events = self.log.read(session_id)
        if (final := _final_step(events)) is not None:
            return AgentResult(session_id=session_id, text=final.text, stop_reason="final", steps=[final])
        logged = {e.call_id for e in events if isinstance(e, ApprovalDecided)}
        for turn_id, held in turns_awaiting(events, self.orchestrator.approvals.store, session_id).items():
            settlement = self.orchestrator.approvals.settle(session_id, turn_id)
            if settlement.waiting:
                return AgentResult(session_id=session_id, text="", stop_reason="waiting_approval", steps=[],
                                   awaiting_approval=settlement.waiting)
            # Only what the log lacks: a resume that crashed half way is simply resumed again.
            for approval in settlement.decided:
                if approval.call.id not in logged:
                    recorder.append(decided_event(approval))
            for result in settlement.results:
                if result.call_id in held:
                    recorder.result(turn_id, result)
        return recorder

    def run(self, prompt: str, *, session_id: str | None = None) -> AgentResult:
        """Run the conversation to a final answer (or `max_steps` model calls), blocking.

        Ends early with `stop_reason="waiting_approval"` when a call waits for a person's decision;
        raises `SessionWaiting` when `session_id` still has such calls (use `resume`).
        """
        session_id = session_id or uuid.uuid4().hex
        with session_lease(self.log, session_id):
            return self._loop(self._begin(prompt, session_id))

    def resume(self, session_id: str) -> AgentResult:
        """Continue a session whose calls waited for a decision, from its event log (any process).

        The decided calls' results (approved calls are waited for) are appended to the log, and
        the next request is rebuilt from it: byte for byte what an uninterrupted run would have
        sent. Still undecided calls give `waiting_approval` again, and nothing is appended. A session
        that already ended gives its final answer again, without asking the model.

        One driver per session: while another process or thread runs or resumes the session, this
        waits for it to finish (`toolchord.orchestrator.session_lease`), then goes on from the log.
        """
        with session_lease(self.log, session_id):
            settled = self._settle(session_id)
            return settled if isinstance(settled, AgentResult) else self._loop(settled)

    async def arun(self, prompt: str, *, session_id: str | None = None) -> AgentResult:
        """asyncio twin of `run`: the model call and the turn are awaited, not blocked on."""
        session_id = session_id or uuid.uuid4().hex
        async with _held(self.log, session_id):
            return await self._aloop(self._begin(prompt, session_id))

    async def aresume(self, session_id: str) -> AgentResult:
        """asyncio twin of `resume`: waiting for the approved calls' results happens in a worker
        thread (the event loop keeps running), the model calls and turns after it are awaited."""
        async with _held(self.log, session_id):
            settled = await asyncio.to_thread(self._settle, session_id)
            return settled if isinstance(settled, AgentResult) else await self._aloop(settled)

    def close(self) -> None:
        """Release the model client and, when the agent built it, the orchestrator."""
        close = getattr(self.client, "close", None)
        if callable(close):
            close()
        if self._own_orchestrator:
            self.orchestrator.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@asynccontextmanager
async def _held(log: EventLog, session_id: str) -> AsyncIterator[None]:
    """`session_lease` for a coroutine: waiting for the lease happens in a worker thread."""
    lease = session_lease(log, session_id)
    await asyncio.to_thread(lease.__enter__)
    try:
        yield
    finally:
        await asyncio.to_thread(lease.__exit__, None, None, None)


def _since_prompt(events: list[Event]) -> list[Event]:
    last = max((i for i, e in enumerate(events) if isinstance(e, UserInput)), default=-1)
    return events[last + 1:]


def _steps_taken(events: list[Event]) -> int:
    """How many model requests were made since the last user input."""
    return sum(1 for e in _since_prompt(events) if isinstance(e, ModelRequest))


def _final_step(events: list[Event]) -> AgentStep | None:
    """The step that ended the session with a final answer (a model output without calls after
    the last prompt, nothing after it), or None when the session goes on."""
    recent = _since_prompt(events)
    outputs = [i for i, e in enumerate(recent) if isinstance(e, ModelOutput)]
    if not outputs:
        return None
    output = recent[outputs[-1]]
    assert isinstance(output, ModelOutput)
    if output.call_ids or any(isinstance(e, ModelRequest) for e in recent[outputs[-1]:]):
        return None
    step = sum(1 for e in recent[:outputs[-1]] if isinstance(e, ModelRequest))
    return AgentStep(step=step, turn_id=output.turn_id, text=assistant_text(output.provider, output.items))


__all__ = ["Agent", "AgentResult", "AgentStep"]
