"""A worker process without privileges for tests/test_sandbox_escapes.py (run as a non-root uid).

`python -m tests.unprivileged_sandbox_worker '<json>'` runs the listed calls of
tests/sandbox_escape_tools.py through `run_isolated` (zygote on) and prints one JSON line per call:
the outcome and the state of the zygote afterwards. In arguments, "$zygote" and "$worker" stand
for those processes' pids. `"landlock": false` runs without the Landlock layer, as on a kernel
without it (no signal scoping). `"concurrent": true` runs all the calls at once (one thread each).
The header line also says whether the `disk` layer is available to this worker.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests import sandbox_escape_tools
from tests.sandbox_tools import make_context
from toolchord.worker.sandbox import capabilities, run_isolated
from toolchord.worker.sandbox.zygote import set_zygote_enabled, start_zygote, zygote_pid


def zombie_children(pid: int, settle_seconds: float = 5.0) -> int:
    """How many children of `pid` are zombies (exited, not reaped), once it had up to
    `settle_seconds` to reap them: a call's result arrives before its child is reaped.
    """
    deadline = time.monotonic() + settle_seconds
    while True:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            children = listing.read().split()
        zombies = 0
        for child in children:
            try:
                with open(f"/proc/{child}/stat") as stat:
                    zombies += stat.read().rsplit(")", 1)[1].split()[0] == "Z"
            except (FileNotFoundError, ProcessLookupError):  # gone before the open, or before the read
                continue
        if not zombies or time.monotonic() > deadline:
            return zombies
        time.sleep(0.05)


def zygote_state(pid: int | None) -> dict[str, Any]:
    """Whether the zygote runs, its limits and nice value, and its zombie children."""
    if pid is None:
        return {"alive": False}
    try:
        zombies = zombie_children(pid)
        nofile = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        nice = os.getpriority(os.PRIO_PROCESS, pid)
    except (OSError, ValueError):
        return {"alive": False}
    return {"alive": True, "nofile": list(nofile), "nice": nice, "zombies": zombies}


def substitute(value: Any, pids: dict[str, int | None]) -> Any:
    """The argument with "$zygote"/"$worker" replaced by pids, in lists too."""
    if isinstance(value, list):
        return [substitute(item, pids) for item in value]
    return pids.get(value, value) if isinstance(value, str) else value


def main(request: dict[str, Any]) -> None:
    if not request.get("landlock", True):
        caps = capabilities.probe()
        capabilities._cached = caps.model_copy(
            update={
                "landlock": caps.landlock.model_copy(
                    update={"available": False, "detail": "off for this test"}
                ),
                "landlock_abi": 0,
            }
        )
    set_zygote_enabled(True)
    first = start_zygote([sandbox_escape_tools.__name__])
    print(
        json.dumps({"worker": os.getpid(), "uid": os.getuid(), "zygote": first,
                    "disk": capabilities.probe().disk.model_dump()}),
        flush=True,
    )
    def run_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        spec = getattr(sandbox_escape_tools, name)
        substitutes = {"$zygote": first, "$worker": os.getpid()}
        resolved = {
            key: substitute(value, substitutes) for key, value in arguments.items()
        }
        outcome = run_isolated(spec, spec.args_model(**resolved), make_context(name))
        report = outcome.model_dump(
            include={
                "status",
                "started",
                "data",
                "content",
                "error_type",
                "error_message",
                "sandbox_layers",
            }
        )
        report["zygote_after"] = zygote_state(first)
        report["zygote_now"] = zygote_pid()
        return report

    calls = request["calls"]
    if request.get("concurrent", False):
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            reports = list(pool.map(lambda call: run_call(*call), calls))
        for report in reports:
            print(json.dumps(report), flush=True)
        return
    for name, arguments in calls:
        print(json.dumps(run_call(name, arguments)), flush=True)

if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
