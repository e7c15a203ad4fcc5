"""Celery's hard time limit, kept by the pool process itself when the worker's main process cannot.

The prefork pool enforces a task's hard time limit from the worker's main process, which kills the
pool process running it. While the main process is blocked, on a socket to a partitioned broker or
result backend say, nobody does: measured here, a call ran 40 s against an 11 s hard limit, until
the partition ended. So every prefork pool process also arms a watchdog of its own for each task
with a hard limit, `GRACE` seconds past it: a POSIX timer (`timer_create`, CLOCK_MONOTONIC) that
sends the process `WATCHDOG_SIGNAL`, whose handler is `faulthandler`'s (C, no GIL needed): it
writes every thread's traceback to the worker's stderr, then the signal's default action ends the
process. When the main process is well it kills first and the watchdog never goes off. When the
watchdog does, the main process sees a pool process lost (WorkerLostError, once it is unblocked),
and the call task, with `acks_late` and `reject_on_worker_lost`, is delivered again: the claim
decides what that delivery does (docs/idempotency.md).

A timer is armed and disarmed with one system call each (about 5 us for both, from Python). `faulthandler`'s own
`dump_traceback_later`, used before, starts a thread at every arm and joins it at every cancel:
30 to 50 us per task, and milliseconds when the machine is busy and the thread waits for a CPU.

`WATCHDOG_SIGNAL` is the watchdog's in a pool process: tool modules must not use it. The embedded
worker's thread pool has no pool process to end, and no hard limit: nothing is armed.
"""

from __future__ import annotations

import faulthandler
import signal
from typing import Any

from celery.signals import task_postrun, task_prerun, worker_process_init

from toolchord.worker.sandbox.syscalls import CLOCK_MONOTONIC, timer_create, timer_settime

# Seconds past the hard limit: the main process, when it is not blocked, ends the task first.
GRACE = 2.0
WATCHDOG_SIGNAL = signal.SIGRTMIN + 3
"""A real-time signal: nothing else in a worker uses it, and its default action ends the process."""
_STDERR_FD = 2


class Watchdog:
    """One process's watchdog: once armed, ends the process (after writing every thread's
    traceback to stderr) unless disarmed or armed again in time. Not inherited by forked
    children (POSIX timers never are)."""

    def __init__(self) -> None:
        # chain: after the tracebacks, the previous disposition (the default: end the process).
        faulthandler.register(WATCHDOG_SIGNAL, file=_STDERR_FD, all_threads=True, chain=True)
        self._timer = timer_create(CLOCK_MONOTONIC, WATCHDOG_SIGNAL)

    def arm(self, seconds: float) -> None:
        """Go off `seconds` from now (replacing any earlier arming)."""
        timer_settime(self._timer, seconds)

    def disarm(self) -> None:
        """Go off never (until armed again)."""
        timer_settime(self._timer, 0)


_watchdog: Watchdog | None = None


def hard_limit_of(task: Any) -> float | None:
    """The hard time limit of the task being run (from its message, else the task's own), or None."""
    limits = getattr(task.request, "timelimit", None) or (None, None)
    limit = limits[0] or getattr(task, "time_limit", None)
    return float(limit) if limit else None


@worker_process_init.connect
def _pool_process_started(**_: Any) -> None:
    global _watchdog
    _watchdog = Watchdog()


@task_prerun.connect
def _arm(task: Any = None, **_: Any) -> None:
    if _watchdog is None or task is None:
        return
    limit = hard_limit_of(task)
    if limit is not None:
        _watchdog.arm(limit + GRACE)


@task_postrun.connect
def _disarm(**_: Any) -> None:
    if _watchdog is not None:
        _watchdog.disarm()


__all__ = ["GRACE", "WATCHDOG_SIGNAL", "Watchdog", "hard_limit_of"]
