"""Run sandboxed calls from an unprivileged worker process: a fork of the test process that drops
to an ordinary uid before it calls `run_isolated`, so no per-call uid is involved.

The interpreter may live under a private home that the uid cannot read, so the worker process is
forked (everything it needs is imported first) and its calls use direct forks, not a zygote.
"""

from __future__ import annotations

import os
from typing import Any

from tests import sandbox_tools as tools
from toolchord.orchestrator.bench.processes import output_of_fork
from toolchord.worker.execution import HandlerOutcome

# One per test process: pytest-xdist workers running these tests at once must not share a uid.
WORKER_UID = 60_000 + os.getpid() % 5_000
"""An unprivileged uid no other test process uses."""


def run_unprivileged(name: str, env: dict[str, str] | None = None, cgroups: tuple[str, ...] = (),
                     without: tuple[str, ...] = (), **arguments: Any) -> HandlerOutcome:
    """Run sandbox tool `name` through run_isolated in a forked worker process running as WORKER_UID,
    placed first in `cgroups` (directories delegated to that uid) when given, with the layers named
    in `without` off as on a host that lacks them."""
    from toolchord.worker.sandbox import capabilities, runner, workdir, zygote

    def call() -> bytes:
        try:
            for directory in cgroups:
                with open(os.path.join(directory, "cgroup.procs"), "w") as procs:
                    procs.write("0")
            os.setgroups([])
            os.setgid(WORKER_UID)
            os.setuid(WORKER_UID)
            os.environ.update(env or {})
            capabilities._cached = None
            if without:
                probed = capabilities.probe()
                capabilities._cached = probed.model_copy(update={
                    layer: getattr(probed, layer).model_copy(update={"available": False, "detail": "off for this test"})
                    for layer in without
                })
            zygote.set_zygote_enabled(False)
            workdir._root = None
            spec = getattr(tools, name)
            outcome = runner.run_isolated(spec, spec.args_model(**arguments), tools.make_context(name))
            workdir.wait_for_removals()  # the fork ends with os._exit, which skips the atexit hook that waits
            return outcome.model_dump_json().encode()
        except BaseException as exc:  # noqa: BLE001 - reported to the test as a value
            return HandlerOutcome(status="error", error_type="WorkerRaised",
                                  error_message=f"{type(exc).__name__}: {exc}").model_dump_json().encode()

    return HandlerOutcome.model_validate_json(output_of_fork(call))


def user_namespaces_refused() -> bool:
    """Whether this kernel refuses WORKER_UID a user namespace (sysctls, AppArmor, a container's
    seccomp profile): then an unprivileged worker has no `disk` or `netns` layer."""
    from toolchord.worker.sandbox.syscalls import CLONE_NEWUSER, unshare

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(WORKER_UID)
            os.setuid(WORKER_UID)
            unshare(CLONE_NEWUSER)
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
