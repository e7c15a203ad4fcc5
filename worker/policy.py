"""What each side-effect class means, in one table (docs/tools.md, "Side-effect classes").

Tasks (which task runs a call, when an attempt is retried, when a lost attempt is reconciled),
results (a started attempt nobody saw end), deadline sizing, the chord's lost results, late
results and history repair all read the class's policy here instead of comparing class names, so
a new class is a new `SideEffect` literal (worker/models.py) and a new row below.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolchord.worker.models import SideEffect


@dataclass(frozen=True)
class SideEffectPolicy:
    """How toolchord runs, retries and reports the calls of one side-effect class."""

    task_name: str
    """The Celery task that runs the class's calls."""
    repeatable: bool
    """Running the call again after an attempt started is harmless: a transient failure or a first
    timeout of a started attempt is retried, and a redelivered call whose attempt was lost runs
    again. When False, a started attempt is never repeated blindly: a lost one is reconciled."""
    unobserved_is_unknown: bool
    """A started attempt whose end nobody saw (killed at its timeout, crashed, lost with its worker,
    result lost, turn stopped waiting) is reported OUTCOME_UNKNOWN: it may have taken effect.
    When False it is reported as what happened (TIMEOUT, EXECUTION_ERROR, ABORTED, ...)."""
    deadline_attempts: int
    """How many timeouts of the tool a turn's default deadline makes room for (retries included)."""
    read_only: bool
    """The call changes nothing (announced as an MCP read-only hint)."""
    eager: bool
    """A call may start while the model's message is still streaming, as soon as its own arguments
    are complete (docs/agent-loop.md, "Eager dispatch"). When False it waits until the message ended
    cleanly: a message cut by `max_tokens`, a dropped connection or a refusal never starts it."""


SIDE_EFFECT_POLICIES: dict[SideEffect, SideEffectPolicy] = {
    "read": SideEffectPolicy(task_name="toolchord.call.read", repeatable=True, unobserved_is_unknown=False,
                             deadline_attempts=2, read_only=True, eager=True),
    "idempotent": SideEffectPolicy(task_name="toolchord.call.idempotent", repeatable=True,
                                   unobserved_is_unknown=False, deadline_attempts=2, read_only=False, eager=True),
    "unsafe": SideEffectPolicy(task_name="toolchord.call.unsafe", repeatable=False, unobserved_is_unknown=True,
                               deadline_attempts=1, read_only=False, eager=False),
}

_BY_NAME: dict[str, SideEffectPolicy] = {str(name): policy for name, policy in SIDE_EFFECT_POLICIES.items()}


def policy_of(side_effect: SideEffect | str | None) -> SideEffectPolicy:
    """The policy of a class; an unknown or missing class gets the most careful one (`unsafe`)."""
    return _BY_NAME.get(side_effect or "", SIDE_EFFECT_POLICIES["unsafe"])


__all__ = ["SIDE_EFFECT_POLICIES", "SideEffectPolicy", "policy_of"]
