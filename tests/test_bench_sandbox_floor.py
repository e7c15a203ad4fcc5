"""The floor under `bench sandbox`'s CPU target: what a process per call costs with nothing of the
sandbox run, measured by forking from a real interpreter that imports what the zygote imports."""

from __future__ import annotations

import pytest

from toolchord.orchestrator.bench.sandbox_floor import (
    ZYGOTE_IMPORTS,
    ForkCost,
    ForkFloor,
    ProcessFloor,
    fork_floor,
    format_floor,
)

pytestmark = pytest.mark.timeout(60)


def test_forks_from_the_zygotes_imports_cost_more_than_from_a_bare_interpreter() -> None:
    zygote = fork_floor(["tests.sandbox_tools", *ZYGOTE_IMPORTS], forks=30)
    bare = fork_floor([], forks=30)
    # The children really ran and were counted: a fork whose child exits at once still costs CPU
    # and faults in the child, and pydantic and the worker side make the interpreter larger.
    assert zygote.python.child_faults > 0
    assert zygote.python.total_ms > 0
    assert zygote.anonymous_mb > bare.anonymous_mb + 2


def _floor(fork_ms: float) -> ProcessFloor:
    cost = ForkCost(parent_cpu_ms=fork_ms / 2, child_cpu_ms=fork_ms / 2, child_faults=100)
    return ProcessFloor(
        zygote_fork=ForkFloor(anonymous_mb=18.0, python=cost, raw=None),
        bare_fork=ForkFloor(anonymous_mb=5.0, python=cost, raw=None),
        cgroup_ms=0.4,
        workdir_ms=0.2,
    )


def test_a_floor_above_the_target_is_reported_as_not_reachable() -> None:
    text = format_floor(_floor(3.0), 18.5, target_ms=3.0)
    assert "floor: 3.600 ms per call" in text
    assert "0.600 ms below it: not reachable with a process per call" in text
    assert "the running zygote: 18.5 MB" in text


def test_a_floor_below_the_target_says_what_it_leaves() -> None:
    text = format_floor(_floor(1.0), None, target_ms=3.0)
    assert "leaves 1.400 ms for the layers, the call and its dispatch" in text
    assert "not reachable" not in text
