"""Celery's hard time limit, kept by the pool process itself when the worker's main process cannot.

The prefork pool enforces a task's hard time limit from the worker's main process, which kills the
pool process running it. While the main process is blocked, on a socket to a partitioned broker or
result backend say, nobody does: measured here, a call ran 40 s against an 11 s hard limit, until
the partition ended. So every prefork pool process also arms a watchdog of its own for each task
with a hard limit, `GRACE` seconds past it: `faulthandler.dump_traceback_later(exit=True)`, a C
thread that needs no GIL, writes every thread's traceback to the worker's stderr ("Timeout
(0:00:13)!") and ends the process with `_exit(1)`. When the main process is well it kills first and
the watchdog never goes off. When the watchdog does, the main process sees a pool process lost
(WorkerLostError, once it is unblocked), and the call task, with `acks_late` and
`reject_on_worker_lost`, is delivered again: the claim decides what that delivery does
(docs/idempotency.md).

A process has one such faulthandler timer: tool modules must not use `dump_traceback_later`.
The embedded worker's thread pool has no pool process to end, and no hard limit: nothing is armed.
"""

from __future__ import annotations

import faulthandler
from typing import Any

from celery.signals import task_postrun, task_prerun, worker_process_init

# Seconds past the hard limit: the main process, when it is not blocked, ends the task first.
GRACE = 2.0
_STDERR_FD = 2

_in_pool_process = False


def hard_limit_of(task: Any) -> float | None:
    """The hard time limit of the task being run (from its message, else the task's own), or None."""
    limits = getattr(task.request, "timelimit", None) or (None, None)
    limit = limits[0] or getattr(task, "time_limit", None)
    return float(limit) if limit else None


@worker_process_init.connect
def _pool_process_started(**_: Any) -> None:
    global _in_pool_process
    _in_pool_process = True


@task_prerun.connect
def _arm(task: Any = None, **_: Any) -> None:
    if not _in_pool_process or task is None:
        return
    limit = hard_limit_of(task)
    if limit is None:
        return
    # The process's stderr itself (fd 2), not Celery's logging proxy: faulthandler writes from C.
    faulthandler.dump_traceback_later(limit + GRACE, exit=True, file=_STDERR_FD)


@task_postrun.connect
def _disarm(**_: Any) -> None:
    if _in_pool_process:
        faulthandler.cancel_dump_traceback_later()


__all__ = ["GRACE", "hard_limit_of"]
