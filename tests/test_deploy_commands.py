"""Every command the deployment files run is a real command with real options.

Commands are collected from docker-compose.yml (commands and healthchecks), deploy/k8s (container
args and exec probes) and deploy/systemd (ExecStart). `toolchord` commands are checked against the
CLI spec (notes: orchestrator/cli.py) and against the installed CLI's own `--help`; `celery` probe
commands against `celery ... --help` and the app they name.
"""

from __future__ import annotations

import configparser
import functools
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from toolchord.worker.launch import worker_command

ROOT = Path(__file__).resolve().parent.parent

# The CLI's documented options per subcommand. `worker` passes options it does not know to
# `celery worker`, which are checked against Celery's own help instead.
CLI_SPEC: dict[str, set[str]] = {
    "worker": {"--tools", "-Q", "-c", "--loglevel"},
    "flower": {"--address", "--port", "--basic-auth"},
    "demo": set(),
    "run": {"--base-url", "--model", "--provider", "--tools"},
    "replay": {"--provider"},
    "tools": {"--provider", "--tools"},
    "bench": set(),
}
PASSTHROUGH = {"worker": ["celery", "worker"]}


def _shell_commands(script: str) -> Iterator[list[str]]:
    """The simple commands of a shell snippet, without leading VAR=value assignments or `exec`."""
    for part in re.split(r"\|\||&&|[|;]", script):
        argv = shlex.split(part.replace("$$", "$"))
        while argv and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]) or argv[0] == "exec"):
            argv = argv[1:]
        if argv:
            yield argv


def _expand(argv: list[str]) -> Iterator[list[str]]:
    if argv[:2] == ["sh", "-c"]:
        yield from _shell_commands(argv[2])
    elif argv and argv[0] == "CMD-SHELL":
        yield from _shell_commands(argv[1])
    elif argv and argv[0] == "CMD":
        yield argv[1:]
    else:
        yield argv


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def deployed_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) for every command the deployment files run."""
    found: list[tuple[str, list[str]]] = []
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in spec["services"].items():
        if "command" in service and name != "redis":
            found += [(f"compose {name}", argv) for argv in _expand(service["command"])]
        if "healthcheck" in service and name != "redis":
            found += [(f"compose {name} healthcheck", argv) for argv in _expand(service["healthcheck"]["test"])]
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for node in _walk(doc):
                if "image" in node and str(node["image"]).startswith("toolchord"):
                    found += [(f"{path.name} args", argv) for argv in _expand(node.get("args", []))]
                    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                        if "exec" in node.get(probe, {}):
                            found += [
                                (f"{path.name} {probe}", argv) for argv in _expand(node[probe]["exec"]["command"])
                            ]
    unit = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((ROOT / "deploy" / "systemd" / "toolchord-worker.service").read_text())
    found.append(("systemd ExecStart", shlex.split(unit["Service"]["ExecStart"].replace("%%", "%"))))
    return found


def _options(argv: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in argv if arg.startswith("-")]


@functools.cache
def _help(*command: str) -> str:
    done = subprocess.run(
        [*command, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"{' '.join(command)} --help failed: {done.stderr[-2000:]}"
    return done.stdout


def _toolchord_commands() -> list[tuple[str, list[str]]]:
    commands = [(where, argv) for where, argv in deployed_commands() if Path(argv[0]).name == "toolchord"]
    assert commands
    return commands


def _celery_commands() -> list[tuple[str, list[str]]]:
    return [(where, argv) for where, argv in deployed_commands() if argv[0] == "celery"]


def test_every_deployed_command_is_toolchord_or_a_celery_probe() -> None:
    allowed = {"toolchord", "celery", "python"}
    for where, argv in deployed_commands():
        assert Path(argv[0]).name in allowed, f"{where}: unexpected program {argv}"


def test_toolchord_commands_use_only_documented_subcommands_and_options() -> None:
    for where, argv in _toolchord_commands():
        subcommand = argv[1]
        assert subcommand in CLI_SPEC, f"{where}: {subcommand!r} is not a toolchord subcommand"
        unknown = [o for o in _options(argv[2:]) if o not in CLI_SPEC[subcommand]]
        if subcommand in PASSTHROUGH:
            celery_help = _help(sys.executable, "-m", "celery", *PASSTHROUGH[subcommand][1:])
            unknown = [o for o in unknown if not re.search(rf"(^|[\s,]){re.escape(o)}\b", celery_help)]
        assert not unknown, f"{where}: options {unknown} are neither toolchord's nor celery's"


def test_toolchord_subcommands_exist_in_the_installed_cli() -> None:
    """Runs the real console script; fails until orchestrator/cli.py provides these subcommands."""
    for where, argv in _toolchord_commands():
        text = _help(sys.executable, "-c", "from toolchord.orchestrator.cli import main; main()", argv[1])
        for option in _options(argv[2:]):
            if option in CLI_SPEC[argv[1]]:
                assert option in text, f"{where}: `toolchord {argv[1]} --help` does not list {option}"


def test_celery_probe_commands_are_valid() -> None:
    commands = _celery_commands()
    assert commands, "the worker probes/healthchecks should ping the worker through celery"
    for where, argv in commands:
        app_index = argv.index("-A") + 1
        subcommand = [a for a in argv[app_index + 1 :] if not a.startswith("-")][:2]
        assert subcommand == ["inspect", "ping"], where
        help_text = _help(sys.executable, "-m", "celery", "inspect")
        for option in _options(argv[app_index + 1 :]):
            assert re.search(rf"(^|[\s,]){re.escape(option)}\b", help_text), f"{where}: {option}"
        destination = argv[argv.index("-d") + 1]
        assert destination.startswith("toolchord@$"), f"{where}: must address this worker's node"


def test_celery_probe_targets_the_worker_app() -> None:
    from celery import Celery

    targets = {argv[argv.index("-A") + 1] for _, argv in _celery_commands()}
    assert targets == {"toolchord.worker.celery_app:app"}
    import toolchord.worker.celery_app

    assert isinstance(toolchord.worker.celery_app.app, Celery)


def test_probes_address_the_node_name_the_worker_runs_under() -> None:
    """The worker runs as toolchord@%h and every probe pings toolchord@$HOSTNAME."""
    for where, argv in _toolchord_commands():
        if argv[1] == "worker":
            assert argv[argv.index("--hostname") + 1] == "toolchord@%h", where


def test_flower_refuses_a_public_address_without_auth() -> None:
    """The deployments rely on `toolchord flower` refusing to serve unauthenticated off loopback."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    done = subprocess.run(
        [sys.executable, "-c", "from toolchord.orchestrator.cli import main; main()", "flower", "--address", "0.0.0.0", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert done.returncode != 0
    assert "auth" in (done.stderr + done.stdout).lower()


def test_a_worker_given_no_tools_serves_the_demo_tools_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """`toolchord worker` has the default of every other command, so `toolchord demo` on a cluster
    finds its tools (the worker used to start with none and answer every call UNKNOWN_TOOL)."""
    broker = {"TOOLCHORD_BROKER_URL": "redis://x:1/0"}
    args, env = worker_command([], env={**broker, "TOOLCHORD_TOOL_MODULES": " "})
    assert env["TOOLCHORD_TOOL_MODULES"] == "toolchord.worker.demo_tools"
    assert "serving the demo tools" in capsys.readouterr().err
    assert args[args.index("--queues") + 1] == "toolchord"
    _, env = worker_command(["--tools", "tests.celery_tools"], env=broker)
    assert env["TOOLCHORD_TOOL_MODULES"] == "tests.celery_tools" and capsys.readouterr().err == ""
