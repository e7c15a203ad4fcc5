"""Take the worker's connection secrets out of reach in a direct fork of the worker.

A direct fork starts with a copy of the worker's heap: the Celery app's broker and backend URLs
(with their passwords), kombu and py-amqp connections, redis-py pools and the toolchord Settings.
Before any tool code runs, the child overwrites those fields and detaches the Python socket
objects whose descriptors it has already closed (so a handler cannot reuse the worker's broker or
Redis connection through a descriptor number that now names something else).

This clears what is reachable through those objects, not freed or copied bytes elsewhere in the
heap: a handler that scans its memory with ctypes may still find a copy. Refusing direct forks
(TOOLCHORD_SANDBOX_DIRECT_FORK=refuse) is the complete answer; see docs/sandbox.md.
"""

from __future__ import annotations

import gc
import socket
import sys
from collections.abc import MutableMapping
from typing import Any

_SECRET_KEY_ENDINGS = ("url", "backend", "password", "transport_options", "login_response")
_SECRET_ATTRIBUTES = (
    "url",
    "hostname",
    "userid",
    "username",
    "password",
    "login_response",
    "credential_provider",
    "broker_url",
    "result_backend",
    "redis_url",
)


def secret_holders() -> tuple[Any, ...]:
    """Every object of a kind that holds connection secrets, found by walking this process's heap.

    Called by the worker right before it forks a direct child, not in the child: the walk touches
    every object (tens of milliseconds in a large worker, seconds under load), and in the child it
    would also copy every page of the heap and count against the call's own time limit."""
    kinds = _secret_kinds()
    # An exact type test against the known classes and their subclasses: `isinstance` walks
    # abstract base classes' hooks and is several times slower over millions of objects.
    return tuple(obj for obj in gc.get_objects() if type(obj) in kinds)


def forget_worker_secrets(holders: tuple[Any, ...]) -> None:
    """In a direct fork: clear the connection secrets of the objects `secret_holders` found.

    Called after the child's descriptors were rearranged and before `gc.freeze()`."""
    for obj in holders:
        _clear(obj)


def _secret_kinds() -> frozenset[type]:
    """The classes whose instances hold connection secrets, among the modules already loaded,
    with all their subclasses."""
    kinds: list[type] = [socket.socket]
    wanted = (
        ("celery.app.base", "Celery"),
        ("celery.backends.base", "Backend"),
        ("kombu.connection", "Connection"),
        ("amqp.connection", "Connection"),
        ("redis.connection", "ConnectionPool"),
        ("redis.connection", "AbstractConnection"),
        ("redis.connection", "Connection"),
        ("redis.sentinel", "Sentinel"),
        ("toolchord.worker.config", "Settings"),
    )
    for module_name, name in wanted:
        module = sys.modules.get(module_name)
        kind = getattr(module, name, None) if module is not None else None
        if isinstance(kind, type):
            kinds.append(kind)
    found: set[type] = set()
    while kinds:
        kind = kinds.pop()
        if kind not in found:
            found.add(kind)
            kinds.extend(kind.__subclasses__())
    return frozenset(found)


def _clear(obj: Any) -> None:
    if isinstance(obj, socket.socket):
        # Its descriptor is closed already (or is now one of the child's own): forget the number.
        obj.detach()
        return
    # The instance's own fields only: a property could connect or load configuration.
    fields = _instance_fields(obj)
    conf = fields.get("_conf")  # a Celery app's configuration (a chain of mappings)
    for mapping in (*_instance_fields(conf).get("maps", ()), fields.get("_preconf")):
        if isinstance(mapping, MutableMapping):
            _clear_mapping(mapping)
    for attribute in (
        "connection_kwargs",
        "_connection_kwargs",
        "connparams",
        "sentinel_kwargs",
        "_initial_params",
    ):
        mapping = fields.get(attribute)
        if isinstance(mapping, MutableMapping):
            _clear_mapping(mapping)
    for attribute in _SECRET_ATTRIBUTES:
        if fields.get(attribute) is not None:
            fields[attribute] = None
    for mechanism in fields.get("authentication") or ():
        # py-amqp's SASL mechanisms (PLAIN, AMQPLAIN) keep the user name and password.
        mechanism_fields = _instance_fields(mechanism)
        for attribute in ("username", "password"):
            if attribute in mechanism_fields:
                mechanism_fields[attribute] = None


def _instance_fields(obj: object) -> dict[str, Any]:
    """The object's own attributes (a pydantic model's fields too), or {} without a __dict__."""
    try:
        return vars(obj)
    except TypeError:
        return {}


def _clear_mapping(mapping: MutableMapping[Any, Any]) -> None:
    for key in list(mapping):
        name = key.lower() if isinstance(key, str) else ""
        if name.endswith(_SECRET_KEY_ENDINGS) or name == "username":
            mapping[key] = None
