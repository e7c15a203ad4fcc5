"""A worker process for tests/test_sandbox_direct_forks.py: `python -m tests.direct_fork_secrets_worker`.

Started with TOOLCHORD_BROKER_URL (a password in it) in its environment, it makes its Celery app,
a kombu connection and its Redis client the way a worker does (none of them connects), then runs
a tool defined inside a function, so the zygote cannot import it and it runs in a direct fork of
this process. The tool reports everything it finds where the worker keeps those secrets; the
report is printed as one JSON line.
"""

from __future__ import annotations

import json
import os
import posix
import sys
from typing import Any

from tests.sandbox_tools import make_context
from toolchord.worker import tool
from toolchord.worker.celery_app import create_app
from toolchord.worker.sandbox import run_isolated
from toolchord.worker.sandbox.zygote import set_zygote_enabled
from toolchord.worker.worker_runtime import runtime_of


def proc_environ() -> str:
    """This process's initial environment block as the kernel shows it (if /proc is reachable)."""
    try:
        with open("/proc/self/environ", "rb") as block:
            return block.read().decode("latin-1")
    except OSError as exc:
        return f"unreadable: {exc}"


def main() -> None:
    app = create_app()
    runtime = runtime_of(app)
    kombu_connection = app.connection_for_write()
    redis_client = runtime.redis
    assert redis_client is not None

    @tool(timeout=20)
    def look_for_the_broker_password() -> dict[str, Any]:
        """What a hostile handler reads where the worker keeps its connection secrets."""
        return {
            "app.conf.broker_url": repr(app.conf.broker_url),
            "app.conf.result_backend": repr(app.conf.result_backend),
            "app._preconf": repr(dict(app._preconf)),
            "app.conf maps": repr([dict(m) for m in app.conf.maps]),
            "kombu": repr((kombu_connection.hostname, kombu_connection.userid, kombu_connection.password)),
            "redis kwargs": repr(redis_client.connection_pool.connection_kwargs),
            "settings": repr(runtime.settings.model_dump()),
            "os.environ": repr(dict(os.environ)),
            "posix.environ": repr(posix.environ),
            "proc environ": proc_environ(),
        }

    set_zygote_enabled(sys.argv[1] == "zygote")
    outcome = run_isolated(
        look_for_the_broker_password,
        look_for_the_broker_password.args_model(),
        make_context("look_for_the_broker_password"),
    )
    print(json.dumps({"outcome": outcome.model_dump(mode="json")}))


if __name__ == "__main__":
    main()
