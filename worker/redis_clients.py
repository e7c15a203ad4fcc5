"""One place that turns a toolchord Redis URL into a redis-py client.

Besides `redis://`, `rediss://` and `unix://`, a URL may name Redis Sentinels in the form Celery's
result backend and kombu's transport use: `sentinel://[:password@]host:port[/db]`, several joined
by `;`. The master's name is not part of that form: it comes from TOOLCHORD_REDIS_MASTER_NAME
(Celery and kombu take it as the transport option `master_name`). A Sentinel client asks the
sentinels for the current primary on every new connection, so after a failover the next command
(redis-py retries a failed one) reaches the promoted replica.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = ("sentinel",)
# Seconds a Redis command or connect may wait for an answer before it fails (the broker's, the
# result backend's and toolchord's own connections): over a partition a call fails and is retried
# or given up, instead of blocking a worker until the partition ends (docs/operations.md).
REDIS_SOCKET_TIMEOUT = 5.0
REDIS_SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES)


def scheme_of(url: str | None) -> str:
    """The URL's scheme, lower-cased ("" for None)."""
    return (url or "").split("://", 1)[0].lower()


def is_sentinel_url(url: str | None) -> bool:
    """Whether `url` names Redis Sentinels rather than one Redis server."""
    return scheme_of(url) in SENTINEL_SCHEMES


def is_redis_url(url: str | None) -> bool:
    """Whether `url` is a Redis server or a Sentinel group."""
    return scheme_of(url) in REDIS_SCHEMES


def sentinel_hosts(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The sentinels' addresses and the connection options (db, username, password) of a sentinel URL."""
    hosts: list[tuple[str, int]] = []
    options: dict[str, Any] = {}
    for chunk in url.split(";"):
        parts = urlsplit(chunk.strip())
        if parts.scheme.lower() not in SENTINEL_SCHEMES or not parts.hostname:
            raise ValueError(f"not a sentinel address: {parts.scheme}://{parts.hostname or ''}")
        hosts.append((parts.hostname, parts.port or 26379))
        # As in Celery's SentinelBackend: the first address's db and credentials are the primary's.
        if not options:
            path = parts.path.strip("/")
            options["db"] = int(path) if path else 0
            if parts.username:
                options["username"] = unquote(parts.username)
            if parts.password:
                options["password"] = unquote(parts.password)
    return hosts, options


def redis_client(url: str, *, master_name: str | None = None, **options: Any) -> redis.Redis:
    """A client for `url`; `master_name` is required for a sentinel URL. `options` go to redis-py."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    if not master_name:
        raise ValueError("a sentinel:// Redis URL needs the master's name (TOOLCHORD_REDIS_MASTER_NAME)")
    hosts, connection = sentinel_hosts(url)
    # The sentinels themselves need no password unless sentinel_kwargs says so (as in kombu).
    sentinel = Sentinel(hosts, socket_timeout=options.get("socket_timeout", REDIS_SOCKET_TIMEOUT))
    return sentinel.master_for(master_name, **connection, **options)


__all__ = ["REDIS_SCHEMES", "REDIS_SOCKET_TIMEOUT", "SENTINEL_SCHEMES", "is_redis_url", "is_sentinel_url", "redis_client", "scheme_of",
           "sentinel_hosts"]
