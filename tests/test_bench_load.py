"""The load test in a small configuration: the ledger balances, also across a worker SIGKILL."""

from __future__ import annotations

import pytest

from toolchord.orchestrator.bench.load import LoadConfig, format_table, main, run_scenario
from toolchord.orchestrator.bench.load_ledger import CallOutcome, check_ledger

pytestmark = pytest.mark.slow


@pytest.mark.timeout(75)  # loaded 2-core machine: about 18 s
def test_ledger_balances_under_load() -> None:
    report = run_scenario(LoadConfig(sessions=25, turns=2, calls=2, workers=1, max_seconds=60))
    assert report.completed
    # 25 sessions x 2 turns x 2 calls, plus the warm-up session's 2 turns.
    assert report.ledger.calls == 26 * 2 * 2
    assert report.ledger.ok == report.ledger.calls
    assert report.ledger.reran == 0 and report.ledger.outcome_unknown == 0
    assert report.ledger.balanced
    assert report.inflight_turns >= 26
    assert "| steady | 25x2x2 |" in format_table([report])


@pytest.mark.timeout(90)  # loaded 2-core machine: up to about 19 s
def test_ledger_balances_when_a_worker_is_killed_and_restarted() -> None:
    # Three pool processes: the worker is killed while each runs a call of one class (held in its
    # handler, see bench.load_tools), so the kill lands on running calls of every class and nowhere else.
    report = run_scenario(
        LoadConfig(name="kill", sessions=20, turns=2, calls=2, workers=1, concurrency=3, work_ms=10, kill=True,
                   visibility_timeout=4, claim_lease=1, max_seconds=45, hold_seconds=20)
    )
    assert set(report.killed_running) == {"read", "idempotent", "unsafe"}, report.killed_running
    assert report.completed
    assert report.ledger.balanced, report.ledger
    assert report.ledger.calls == 21 * 2 * 2
    assert report.ledger.unsafe_twice == 0
    # The killed calls were redelivered: the read and idempotent ones ran again, the unsafe one did not.
    assert report.ledger.reran >= 2
    assert report.ledger.outcome_unknown >= 1


@pytest.mark.timeout(90)
def test_the_report_states_toolchord_against_a_bare_celery_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    # Both scenarios through the command line, as a user runs them: the baseline's plain tasks do
    # the tools' work (its ledger balances too) and the summary says MET or MISSED per target.
    code = main(["--sessions", "10", "--turns", "2", "--workers", "1", "--scenarios", "steady,bare",
                 "--max-seconds", "45"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| bare | 10x2x2 | 1x2 | bare Celery |" in out and "| steady | 10x2x2 |" in out
    for target in ("calls/s against bare Celery", "CPU per call against bare Celery", "event-loop lag p99"):
        line = next(line for line in out.splitlines() if line.startswith(target))
        assert line.endswith((": MET", ": MISSED")), line
    assert "ledger balanced in every run: yes" in out


def test_ledger_counts_what_does_not_balance() -> None:
    outcomes = [
        CallOutcome(tag="a", side_effect="unsafe", results=1, status="ok"),
        CallOutcome(tag="b", side_effect="unsafe", results=1, status="error", code="OUTCOME_UNKNOWN"),
        CallOutcome(tag="c", side_effect="read", results=1, status="ok"),
        CallOutcome(tag="d", side_effect="read", results=1, status="error", code="NOT_EXECUTED"),
        CallOutcome(tag="e", side_effect="idempotent", results=0),
        CallOutcome(tag="f", side_effect="idempotent", results=1, status="ok"),
    ]
    report = check_ledger(outcomes, {"a": 2, "b": 1, "c": 3, "d": 0, "f": 0})
    assert (report.unsafe_twice, report.outcome_unknown, report.reran) == (1, 1, 1)
    assert report.results_missing_or_duplicated == 1
    # d (not executed), e (no result) and f (ok without its effect) are lost.
    assert report.lost == 3
    assert not report.balanced
