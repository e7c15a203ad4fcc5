"""Checking that a function's cost grows linearly with its input, on a loaded machine.

Measurements are the CPU time of the calling thread: a busy machine does not inflate it, and
threads that earlier tests left running are not counted. The cyclic garbage collector is off during
a measurement: a full collection walks every object the test process holds (hundreds of earlier
tests' worth), so whether one lands inside the call measures the process, not the function. A call that runs far too long (a
quadratic version on megabytes of input runs for hours) is interrupted by a timer signal, which
fails the test instead of hanging it: the regex engine and the interpreter both check signals.
"""

from __future__ import annotations

import gc
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

# A linear function takes about 10x longer on 10x the input; a quadratic one 100x.
_MAX_GROWTH = 30.0
# Below this, the small input's time is noise: compare against it instead.
_TIMER_FLOOR = 0.02
# "Well under a few seconds" of CPU for the large input, with room for a slow machine.
_MAX_LARGE_SECONDS = 8.0
_WALL_TIMEOUT = 30.0


class _TooSlow(Exception):
    """Raised by the timer signal inside the measured call."""


def cpu_seconds(fn: Callable[[Any], object], arg: Any, timeout: float = _WALL_TIMEOUT) -> float:
    """CPU seconds of `fn(arg)` in this thread; fails the test when it runs past `timeout` seconds."""

    def give_up(signum: int, frame: object) -> None:
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, give_up)
    gc.collect()
    gc.disable()
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        start = time.thread_time()
        fn(arg)
        return time.thread_time() - start
    except _TooSlow:
        pytest.fail(f"{getattr(fn, '__name__', fn)} ran for more than {timeout:g} s: not linear", pytrace=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        gc.enable()
        signal.signal(signal.SIGALRM, previous)


def assert_linear(fn: Callable[[Any], object], make: Callable[[int], Any], small: int = 1_000_000,
                  large: int = 10_000_000) -> tuple[float, float]:
    """Fail unless `fn(make(large))` costs at most ~linear growth over `fn(make(small))`."""
    small_input = make(small)
    small_time = min(cpu_seconds(fn, small_input) for _ in range(2))
    del small_input
    large_time = cpu_seconds(fn, make(large))
    limit = _MAX_GROWTH * max(small_time, _TIMER_FLOOR)
    assert large_time <= limit, f"{large}: {large_time:.2f} s vs {small}: {small_time:.3f} s: grows faster than linear"
    assert large_time <= _MAX_LARGE_SECONDS, f"{large}: {large_time:.2f} s of CPU"
    return small_time, large_time
