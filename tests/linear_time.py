"""Checking that a function's cost grows linearly with its input, on a loaded machine.

Each measurement runs in a forked child, which reports the CPU seconds the call took: CPU time is
what a busy machine does not inflate, and a child that runs far too long (a quadratic version
on megabytes of input runs for hours) is killed, which fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
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
_WALL_TIMEOUT = 60.0


def cpu_seconds(fn: Callable[[Any], object], arg: Any, timeout: float = _WALL_TIMEOUT) -> float:
    """CPU seconds of `fn(arg)` in a forked child; fails the test when it runs past `timeout`."""
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)

    def measure() -> None:
        start = time.process_time()
        fn(arg)
        sender.send(time.process_time() - start)

    child = ctx.Process(target=measure, daemon=True)
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout):
            pytest.fail(f"{getattr(fn, '__name__', fn)} ran for more than {timeout:g} s: not linear", pytrace=False)
        try:
            return receiver.recv()
        except EOFError:
            pytest.fail(f"{getattr(fn, '__name__', fn)} died in the measuring child", pytrace=False)
    finally:
        child.kill()
        child.join()
        receiver.close()


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
