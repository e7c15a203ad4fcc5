"""The load test's ledger: what each call returned against how often it really ran.

A call balances when it has exactly one result and:
- it returned `ok` and its side effect was counted at least once (read/idempotent may re-run
  after a worker was lost; an `unsafe` call exactly once), or
- it is `unsafe`, returned `OUTCOME_UNKNOWN`, and its effect was counted at most once.
Anything else is *lost* (no result, NOT_EXECUTED, TIMEOUT, a result without its effect).
"""

from __future__ import annotations

from pydantic import BaseModel

from toolchord.worker.models import ErrorCode, SideEffect
from toolchord.worker.policy import policy_of


class CallOutcome(BaseModel):
    """What the orchestrator returned for one planned call."""

    tag: str
    side_effect: SideEffect
    results: int  # how many results carried this call's id (exactly one expected)
    status: str | None = None
    code: str | None = None


class LedgerReport(BaseModel):
    """The balance of one run."""

    calls: int
    ok: int
    results_missing_or_duplicated: int
    reran: int  # read/idempotent calls whose effect ran more than once (allowed)
    unsafe_twice: int
    outcome_unknown: int
    lost: int
    lost_examples: list[str]

    @property
    def balanced(self) -> bool:
        return self.results_missing_or_duplicated == 0 and self.unsafe_twice == 0 and self.lost == 0


def check_ledger(outcomes: list[CallOutcome], effects: dict[str, int]) -> LedgerReport:
    """Balance the calls' results against their counted side effects (`effects` by tag)."""
    ok = bad_results = reran = unsafe_twice = unknown = lost = 0
    examples: list[str] = []
    for outcome in outcomes:
        count = effects.get(outcome.tag, 0)
        if outcome.results != 1:
            bad_results += 1
        once_only = not policy_of(outcome.side_effect).repeatable
        if once_only and count > 1:
            unsafe_twice += 1
        elif count > 1:
            reran += 1
        if outcome.status == "ok" and count >= 1:
            ok += 1
        elif once_only and outcome.code == ErrorCode.OUTCOME_UNKNOWN.value and count <= 1:
            unknown += 1
        else:
            lost += 1
            if len(examples) < 5:
                examples.append(f"{outcome.tag} ({outcome.side_effect}): {outcome.status}/{outcome.code}, ran {count}x")
    return LedgerReport(
        calls=len(outcomes),
        ok=ok,
        results_missing_or_duplicated=bad_results,
        reran=reran,
        unsafe_twice=unsafe_twice,
        outcome_unknown=unknown,
        lost=lost,
        lost_examples=examples,
    )
