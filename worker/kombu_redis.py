"""kombu's Redis transports, with a channel that fails like a lost connection once it is released.

kombu 5.7.0 (the latest release) has a worker exit on a short Redis restart when it has a call in
flight and a free pool slot, so its consumer is inside BRPOP: on the connection error Celery's
consumer first collects the connection (the channel's close fails in the BRPOP read and the
transport is released), then closes it, and the second close restores the unacknowledged message
through the released transport: `_connparams` reads `None.hostname`, the AttributeError escapes
`ignore_errors` (which expects connection errors) and Celery ends the worker with "Unrecoverable
error". The same crash was reported upstream on other close paths (celery/kombu#582, #970).

Here a released channel raises redis-py's ConnectionError instead, which kombu and Celery already
treat as "the connection is gone": the consumer reconnects, and the unacknowledged message, which
could not be written back to a Redis that was down anyway, is redelivered by the visibility-timeout
sweep. Drop this module once a kombu release fixes the close path.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis


class _ReleasedConnectionIsLost:
    """Mixin for kombu's Redis channels: connection parameters of a released transport are a lost connection."""

    connection: Any

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection is None or self.connection.client is None:
            raise redis.ConnectionError("the broker connection was released")
        params: dict[str, Any] = super()._connparams(asynchronous)  # type: ignore[misc]
        return params


class Channel(_ReleasedConnectionIsLost, kombu_redis.Channel):
    """kombu's Redis channel (see the module docstring)."""


class Transport(kombu_redis.Transport):
    """kombu's `redis://` transport with `Channel`."""

    Channel = Channel


class SentinelChannel(_ReleasedConnectionIsLost, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel (see the module docstring)."""


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's `sentinel://` transport with `SentinelChannel`."""

    Channel = SentinelChannel


# The broker URL schemes served by these transports (a `rediss://` or `unix://` broker keeps kombu's
# own: the scheme itself selects their TLS or socket handling).
TRANSPORTS: dict[str, str] = {
    "redis": f"{__name__}:Transport",
    "sentinel": f"{__name__}:SentinelTransport",
}

__all__ = ["TRANSPORTS", "Channel", "SentinelChannel", "SentinelTransport", "Transport"]
