"""One error for every store outage, whatever the store is built on.

The Redis-backed stores (idempotency, spill, turns, approvals, event log, cancel channel) raise
`StoreUnavailable` when Redis cannot be reached or refuses an operation, with the Redis error as
its cause; callers catch this one type and never the client library's.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class StoreUnavailable(Exception):
    """A store could not be read or written (unreachable, failing over, refusing); the cause is chained."""


def store_operation(method: Callable[P, R]) -> Callable[P, R]:
    """Turn the Redis errors of one store operation into `StoreUnavailable` (the store's boundary)."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            if _is_redis_error(exc):
                raise StoreUnavailable(f"{method.__qualname__}: {exc}") from exc
            raise

    return wrapper


def _is_redis_error(exc: Exception) -> bool:
    # redis-py is not imported here: tool modules reach this module through `Limit`, and the
    # sandbox zygote that imports them has no use for it. An error of redis-py's can only
    # exist once redis-py was imported by someone.
    redis = sys.modules.get("redis")
    return redis is not None and isinstance(exc, redis.RedisError)


__all__ = ["StoreUnavailable", "store_operation"]
