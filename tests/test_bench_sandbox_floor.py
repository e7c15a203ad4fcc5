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
    zygote = fork_floor(["tests.sandbox_tools", *ZYGOTE_IMPORTS], forks=30, call=True)
    bare = fork_floor([], forks=30, call=False)
    # The children really ran and were counted: a fork whose child exits at once still costs CPU
    # and faults in the child, and pydantic and the worker side make the interpreter larger.
    assert zygote.python.child_faults > 0
    assert zygote.python.total_ms > 0
    assert zygote.anonymous_mb > bare.anonymous_mb + 2
    # A child that runs a call (its result checked by the forking process) touches more pages
    # than one that exits at once; the bare interpreter has no pydantic to run one with.
    assert zygote.call is not None and zygote.call.child_faults > zygote.python.child_faults
    assert bare.call is None


def _floor(fork_ms: float) -> ProcessFloor:
    cost = ForkCost(parent_cpu_ms=fork_ms / 2, child_cpu_ms=fork_ms / 2, child_faults=100)
    exits = ForkCost(parent_cpu_ms=0.1, child_cpu_ms=0.1, child_faults=50)
    return ProcessFloor(
        zygote_fork=ForkFloor(anonymous_mb=18.0, python=exits, call=cost, raw=None),
        bare_fork=ForkFloor(anonymous_mb=5.0, python=exits, call=None, raw=None),
        cgroup_ms=0.4,
        workdir_ms=0.2,
    )


def test_a_floor_above_the_target_is_reported_as_not_reachable() -> None:
    # The floor counts the child that runs a call (not the one that exits at once), its cgroup and
    # workdir; the layers' CPU comes from the profile.
    text = format_floor(_floor(2.0), 18.5, layers_ms=1.0, target_ms=3.0)
    assert "floor: 2.600 ms per call" in text
    assert "1.000 ms): 3.600 ms" in text
    assert "0.600 ms above it: not reachable with a process per call" in text
    assert "the running zygote: 18.5 MB" in text


def test_a_floor_below_the_target_says_what_it_leaves() -> None:
    text = format_floor(_floor(1.0), None, layers_ms=0.5, target_ms=3.0)
    assert "leaves 0.900 ms for the call's dispatch and the rest of the child" in text
    assert "not reachable" not in text
