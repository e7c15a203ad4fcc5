"""`toolchord worker` and `toolchord flower`: Celery's own commands on toolchord's app.

Both replace the current process with `celery -A toolchord.worker.celery_app:app ...` so signals, pool
management and Flower behave exactly as Celery documents them.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence

from toolchord.worker.config import ConfigError, Settings

APP = "toolchord.worker.celery_app:app"


DEMO_TOOL_MODULES = "toolchord.worker.demo_tools"
"""The tools every command serves when neither --tools nor TOOLCHORD_TOOL_MODULES names any."""


def _exec_celery(args: list[str], env: dict[str, str]) -> None:
    command = [sys.executable, "-m", "celery", "-A", APP, *args]
    os.execvpe(sys.executable, command, env)


def worker_command(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The `celery worker` arguments and environment for `toolchord worker` (exposed for tests)."""
    parser = argparse.ArgumentParser(prog="toolchord worker", description="Start a toolchord Celery worker.")
    parser.add_argument("--tools", help="comma-separated tool modules (default: $TOOLCHORD_TOOL_MODULES, else the demo tools)")
    parser.add_argument("-Q", "--queues", help="queues to consume (default: every queue the tools use)")
    parser.add_argument("-c", "--concurrency", type=int, help="pool processes (default: CPU count)")
    parser.add_argument("-n", "--hostname", help="worker node name")
    parser.add_argument("--loglevel", default="INFO")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (needs toolchord[metrics])")
    parser.add_argument("--metrics-address", default="127.0.0.1", help="address of the metrics endpoint")
    known, extra = parser.parse_known_args(argv)
    env = dict(os.environ if env is None else env)
    if known.tools:
        env["TOOLCHORD_TOOL_MODULES"] = known.tools
    elif not env.get("TOOLCHORD_TOOL_MODULES", "").strip():
        # The default of every other command: a worker serves the tools `toolchord demo` and
        # `toolchord run` send, instead of none (every call would come back UNKNOWN_TOOL).
        env["TOOLCHORD_TOOL_MODULES"] = DEMO_TOOL_MODULES
        print(f"toolchord worker: no --tools and no TOOLCHORD_TOOL_MODULES: serving the demo tools ({DEMO_TOOL_MODULES})",
              file=sys.stderr)
    if known.metrics_port is not None:
        _metrics_env(env, known.metrics_port, known.metrics_address)
    settings = Settings.from_env(env)
    if settings.embedded:
        raise ConfigError("toolchord worker needs TOOLCHORD_BROKER_URL: embedded mode runs its worker in-process")
    args = ["worker", "--pool", "prefork", "--loglevel", known.loglevel]
    if settings.task_events:
        args.append("--task-events")
    if known.queues:
        args += ["--queues", known.queues]
    else:
        from toolchord.worker.celery_app import queues_of
        from toolchord.worker.registry import Registry

        args += ["--queues", ",".join(sorted(queues_of(Registry.from_modules(settings.tool_modules), settings)))]
    if known.concurrency:
        args += ["--concurrency", str(known.concurrency)]
    if known.hostname:
        args += ["--hostname", known.hostname]
    return args + list(extra), env


def _metrics_env(env: dict[str, str], port: int, address: str) -> None:
    """Prefork children write their metrics to files the main process serves (prometheus-client's
    multiprocess mode); the directory must be known before any process imports the client."""
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError("--metrics-port needs prometheus-client: pip install 'toolchord[metrics]'")
    env["TOOLCHORD_METRICS_PORT"] = str(port)
    env["TOOLCHORD_METRICS_ADDRESS"] = address
    directory = env.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="toolchord-metrics-"))
    from toolchord.worker.observability.metrics import wipe_multiprocess_dir

    wipe_multiprocess_dir(directory)


def run_worker(argv: Sequence[str] | None = None) -> int:
    """Start a prefork worker with the project's app and tool modules (does not return on success)."""
    try:
        args, env = worker_command(argv)
    except ConfigError as exc:
        print(f"toolchord worker: {exc}", file=sys.stderr)
        return 2
    _exec_celery(args, env)
    return 0


def is_loopback(address: str) -> bool:
    """Whether a listen address only accepts connections from this machine."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def basic_auth(explicit: str | None, env: Mapping[str, str], variable: str) -> str | None:
    """`user:password` from the option, else `$variable`, else the file named by `$variable_FILE`."""
    auth = explicit or env.get(variable)
    if not auth and env.get(f"{variable}_FILE"):
        with open(env[f"{variable}_FILE"]) as handle:
            auth = handle.read().strip()
    return auth or None


def refuse_open_access(what: str, address: str, authenticated: bool, variable: str) -> None:
    """A page that shows every call is served off loopback only behind authentication."""
    if not authenticated and not is_loopback(address):
        raise ConfigError(
            f"refusing to serve {what} on {address} without authentication: "
            f"set {variable}=user:password (or bind to 127.0.0.1)"
        )


def flower_command(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The `celery flower` arguments and environment for `toolchord flower` (exposed for tests).

    Flower shows every call; it is refused on a non-loopback address without authentication.
    """
    parser = argparse.ArgumentParser(prog="toolchord flower", description="Start Flower on toolchord's app.")
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5555)
    parser.add_argument("--basic-auth", help="user:password (prefer FLOWER_BASIC_AUTH or FLOWER_BASIC_AUTH_FILE)")
    known, extra = parser.parse_known_args(argv)
    env = dict(os.environ if env is None else env)
    auth = basic_auth(known.basic_auth, env, "FLOWER_BASIC_AUTH")
    has_oauth = bool(env.get("FLOWER_AUTH_PROVIDER") or any(a.startswith("--auth") for a in extra))
    refuse_open_access("Flower", known.address, bool(auth or has_oauth), "FLOWER_BASIC_AUTH")
    if auth:
        # Through the environment, not argv: a command line is visible to every local user.
        env["FLOWER_BASIC_AUTH"] = auth
    return ["flower", f"--address={known.address}", f"--port={known.port}", *extra], env


def run_flower(argv: Sequence[str] | None = None) -> int:
    """Start Flower on toolchord's app (does not return on success)."""
    try:
        args, env = flower_command(argv)
    except (ConfigError, OSError) as exc:
        print(f"toolchord flower: {exc}", file=sys.stderr)
        return 2
    _exec_celery(args, env)
    return 0
