"""Per-call cost of the sandbox: run_isolated (zygote and direct fork) against calling in-process.

Run with `python -m toolchord.orchestrator.bench.sandbox [--calls N] [--unprivileged UID]`. Prints
the active layers, the median time of a trivial handler called in-process, through the zygote and
through a direct fork of this process, and the median overhead of each sandboxed path. The two
sandboxed paths are sampled alternately, so load from other processes affects both alike. Then
the profile of a zygote call step by step (`sandbox_steps`): wall time on the call's critical path
and CPU, per step and per process, of calls back to back (or `--pause-ms` apart); with
`--unprivileged UID` the same profile once more from a worker process running as that uid (forked
from this one, as tests/unprivileged.py does). Then
the CPU time one zygote call costs summed over every process; the floor under it, what a process
that runs the least a call can, a workdir and a cgroup per call cost here with nothing else run
(`sandbox_floor`), and that with the layers' CPU as profiled; last, each target with MET/MISSED.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Sequence

from pydantic import BaseModel

from toolchord.orchestrator.bench.processes import output_of_fork
from toolchord.orchestrator.bench.sandbox_floor import format_floor, measure_floor
from toolchord.orchestrator.bench.sandbox_steps import StepProfile, format_profile, profile_steps
from toolchord.worker import ToolContext, call_handler
from toolchord.worker.sandbox import describe_layers, run_isolated
from toolchord.worker.sandbox.zygote import set_zygote_enabled, start_zygote, zygote_pid
from toolchord.worker.tools import ToolSpec

TOOL_MODULE = "toolchord.worker.bench_tools"
"""A small tool module: the zygote's heap, hence its forks' cost, is that of a typical worker."""
OVERHEAD_TARGET_MS = 1.0
"""Zygote call overhead on the critical path (median wall, against calling in-process)."""
CPU_TARGET_MS = 3.0
"""CPU per sandboxed call, summed over the worker, the zygote and its children."""


def _timed_ms(run: object) -> float:
    start = time.perf_counter()
    run()  # type: ignore[operator]
    return (time.perf_counter() - start) * 1000


def _verdict(met: bool) -> str:
    return "MET" if met else "MISSED"


def _unprivileged_profile(uid: int, calls: int, pause: float) -> str:
    """The step profile from a fork of this process running as `uid`, as text."""
    from toolchord.worker.sandbox import capabilities, workdir

    def profile() -> bytes:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            capabilities._cached = None
            workdir._root = None
            print(describe_layers(), flush=True)
            spec, args, context = _call()
            # An interpreter this uid cannot run (under a private home) leaves the direct fork.
            path = "zygote" if os.access(sys.executable, os.X_OK) else "direct fork"
            set_zygote_enabled(path == "zygote")
            if path == "zygote":
                start_zygote([spec.handler.__module__])
            for _ in range(10):
                run_isolated(spec, args, context)
            text = format_profile(
                f"unprivileged worker (uid {uid}), {path} call",
                profile_steps(spec, args, context, calls, zygote_pid(), pause),
            )
        except BaseException as exc:  # noqa: BLE001 - reported in the output
            text = f"unprivileged worker (uid {uid}): failed: {type(exc).__name__}: {exc}"
        return text.encode()

    return output_of_fork(profile).decode()


def _anonymous_mb(pid: int | None) -> float | None:
    """A process's anonymous resident memory in MB, None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("RssAnon:"))
    except (OSError, StopIteration):
        return None


LAYER_STEPS = tuple(
    f"child: {step}"
    for step in (
        "cgroup join", "mount namespace and tmpfs", "ipc namespace", "uid", "parent-death signal",
        "landlock", "seccomp", "rlimits",
    )
)
"""The profile's steps that apply a layer (the rest are the call's own work and its dispatch)."""


def _layers_cpu_ms(profile: StepProfile) -> float:
    """CPU per call of the layers' steps, medians, whether a spare ran them ahead or on the path."""
    ahead = {step: cpu for step, (_wall, cpu) in profile.ahead_ms.items()}
    return sum(ahead.get(step, profile.cpu_ms.get(step, 0.0)) for step in LAYER_STEPS)


def _call() -> tuple[ToolSpec, BaseModel, ToolContext]:
    spec: ToolSpec = importlib.import_module(TOOL_MODULE).add
    context = ToolContext(
        call_id="bench",
        session_id="bench",
        tool_name="add",
        idempotency_key="bench",
        deadline=time.time() + 3600,
    )
    return spec, spec.args_model(a=2, b=3), context


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print the median per-call overhead of both sandbox paths."""
    parser = argparse.ArgumentParser(prog="toolchord bench sandbox", description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument(
        "--pause-ms",
        type=float,
        default=0.0,
        help="profile calls this far apart (a worker at rest: spares ready, CPUs idle when a "
        "call arrives); default 0, back to back",
    )
    parser.add_argument(
        "--unprivileged",
        type=int,
        metavar="UID",
        help="also profile a worker process running as this uid (root only)",
    )
    options = parser.parse_args(argv)
    pause = options.pause_ms / 1000
    if options.unprivileged is not None:
        print(_unprivileged_profile(options.unprivileged, options.calls, pause))
    spec, args, context = _call()
    print(describe_layers())
    start_zygote([spec.handler.__module__])
    zygote = zygote_pid()
    print(f"zygote pid: {zygote}")
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
    profile = profile_steps(spec, args, context, options.calls, zygote_pid(), pause)
    set_zygote_enabled(None)
    print(f"layers applied per call: {', '.join(outcome.sandbox_layers)}")
    print(
        f"in-process call_handler:  median {in_process:8.3f} ms over {options.calls} calls"
    )
    overheads = {}
    for name, values in samples.items():
        median = statistics.median(values)
        overheads[name] = median - in_process
        print(
            f"run_isolated, {name + ':':12s} median {median:8.3f} ms, overhead {overheads[name]:8.3f} ms"
        )
    apart = f", {options.pause_ms:g} ms apart" if pause else ", back to back"
    print(format_profile(f"root worker, zygote call{apart}", profile))
    cpu = profile.process_cpu_ms
    cpu_ms = sum(value for name, value in cpu.items() if not name.startswith("whole machine"))
    print(f"CPU per zygote call, all processes: {cpu_ms:8.3f} ms over {options.calls} calls "
          f"(worker, zygote and its children; machine-wide counters, other load included: "
          f"{cpu['whole machine (other load included)']:.3f} ms)")
    floor = measure_floor([TOOL_MODULE], spec.sandbox, options.calls)
    layers_ms = _layers_cpu_ms(profile)
    print(format_floor(floor, _anonymous_mb(zygote), layers_ms, CPU_TARGET_MS))
    print(
        f"target: zygote call overhead <= {OVERHEAD_TARGET_MS:g} ms: "
        f"{overheads['zygote']:.3f} ms {_verdict(overheads['zygote'] <= OVERHEAD_TARGET_MS)}"
    )
    print(
        f"target: CPU per sandboxed call <= {CPU_TARGET_MS:g} ms: "
        f"{cpu_ms:.3f} ms {_verdict(cpu_ms <= CPU_TARGET_MS)} "
        f"(floor of a process per call and the layers here: {floor.total_ms + layers_ms:.3f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
