"""Per-call cost of the sandbox: run_isolated (zygote and direct fork) against calling in-process.

Run with `python -m toolchord.orchestrator.bench.sandbox [--calls N]`. Prints the active layers, the median time of a
trivial handler called in-process, through the zygote and through a direct fork of this process,
and the median overhead of each sandboxed path against the 5 ms target. The two sandboxed paths
are sampled alternately, so load from other processes affects both alike. Last, the CPU time one
zygote call costs summed over every process (worker, zygote, child, kernel), read from the
machine-wide counters in /proc/stat: on an otherwise idle machine that is the sandbox's CPU price.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Sequence

from toolchord.worker import ToolContext, call_handler, tool
from toolchord.worker.sandbox import describe_layers, run_isolated
from toolchord.worker.sandbox.zygote import set_zygote_enabled, start_zygote, zygote_pid
from toolchord.worker.tools import ToolSpec

TARGET_MS = 5.0


@tool(side_effect="read", timeout=10)
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _timed_ms(run: object) -> float:
    start = time.perf_counter()
    run()  # type: ignore[operator]
    return (time.perf_counter() - start) * 1000


def _busy_seconds() -> float:
    """CPU time the whole machine has spent busy (not idle or waiting for I/O) since boot."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print the median per-call overhead of both sandbox paths."""
    parser = argparse.ArgumentParser(prog="toolchord bench sandbox", description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    options = parser.parse_args(argv)
    # Run as `python -m`, this file is __main__, which the zygote cannot import: take the tool
    # from the module imported by name, as a worker's tool modules are.
    spec: ToolSpec = importlib.import_module("toolchord.orchestrator.bench.sandbox").add
    args = spec.args_model(a=2, b=3)
    context = ToolContext(
        call_id="bench",
        session_id="bench",
        tool_name="add",
        idempotency_key="bench",
        deadline=time.time() + 3600,
    )
    print(describe_layers())
    start_zygote([spec.handler.__module__])
    print(f"zygote pid: {zygote_pid()}")
    paths = {"zygote": True, "direct fork": False}
    for (
        enabled
    ) in paths.values():  # warm up: probe, compiled seccomp filter, spares, page cache
        set_zygote_enabled(enabled)
        for _ in range(10):
            outcome = run_isolated(spec, args, context)
            assert outcome.status == "ok" and outcome.content == "5", outcome
    in_process = statistics.median(
        _timed_ms(lambda: call_handler(spec, args, context))
        for _ in range(options.calls)
    )
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(options.calls):
        for name, enabled in paths.items():
            set_zygote_enabled(enabled)
            samples[name].append(_timed_ms(lambda: run_isolated(spec, args, context)))
    set_zygote_enabled(True)
    busy_before = _busy_seconds()
    for _ in range(options.calls):
        run_isolated(spec, args, context)
    # Let the last children exit and be reaped before reading the counters again.
    time.sleep(0.2)
    cpu_ms = (_busy_seconds() - busy_before) / options.calls * 1000
    set_zygote_enabled(None)
    print(f"layers applied per call: {', '.join(outcome.sandbox_layers)}")
    print(
        f"in-process call_handler:  median {in_process:8.3f} ms over {options.calls} calls"
    )
    for name, values in samples.items():
        median = statistics.median(values)
        overhead = median - in_process
        verdict = "within" if overhead < TARGET_MS else "ABOVE"
        print(
            f"run_isolated, {name + ':':12s} median {median:8.3f} ms, overhead {overhead:8.3f} ms "
            f"({verdict} the {TARGET_MS:g} ms target)"
        )
    print(f"CPU per zygote call, all processes: {cpu_ms:8.3f} ms over {options.calls} calls "
          "(machine-wide counters: other load on the machine counts too)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
