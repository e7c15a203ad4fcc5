"""The `toolchord` command line (console script `toolchord = toolchord.orchestrator.cli:main`).

Subcommands: worker, flower (Celery processes, see toolchord.worker.launch), demo, run, replay, tools, limits, ui,
bench, mcp serve (needs the `mcp` extra), approvals (list|approve|deny).
`worker`, `flower` and `bench` hand their arguments on untouched: their own parsers (and Celery's)
own those options.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from toolchord.worker.registry import PROVIDERS, Registry

_PASSTHROUGH = ("worker", "flower", "bench")
_BENCHES = ("turns", "sandbox", "load", "fairness", "stream")


def _registry(modules: str | None) -> Registry:
    """Tools from --tools, else TOOLCHORD_TOOL_MODULES, else the demo tools."""
    from toolchord.worker.launch import DEMO_TOOL_MODULES

    names = modules or os.environ.get("TOOLCHORD_TOOL_MODULES") or DEMO_TOOL_MODULES
    return Registry.from_modules([m.strip() for m in names.split(",") if m.strip()])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolchord", description="Execute LLM agents' tool calls on Celery.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("worker", help="start a Celery worker for the tools (options: toolchord worker --help)",
                   add_help=False)
    sub.add_parser("flower", help="start Flower on toolchord's app (options: toolchord flower --help)", add_help=False)
    sub.add_parser("bench", help=f"run a benchmark: {', '.join(_BENCHES)}", add_help=False)

    demo = sub.add_parser("demo", help="a full multi-turn conversation against a scripted model "
                                       "(embedded, or on the cluster when TOOLCHORD_BROKER_URL is set)")
    demo.add_argument("--provider", choices=PROVIDERS, default="chat")
    demo.add_argument("--stream", action="store_true", help="stream the model's answers")
    demo.add_argument("--log-dir", help="directory for the session log (default: $TOOLCHORD_LOG_DIR)")

    run = sub.add_parser("run", help="run a conversation against a real model server")
    run.add_argument("prompt")
    run.add_argument("--base-url", required=True, help="API base URL (any OpenAI-compatible server, or Anthropic)")
    run.add_argument("--model", required=True)
    run.add_argument("--provider", choices=PROVIDERS, default="chat")
    run.add_argument("--tools", help="comma-separated tool modules (default: $TOOLCHORD_TOOL_MODULES or the demo tools)")
    run.add_argument("--system", help="system prompt")
    run.add_argument("--max-steps", type=int, default=16)
    run.add_argument("--stream", action="store_true")
    run.add_argument("--session", help="continue this session id (default: a new one)")
    run.add_argument("--max-retries", type=int, default=2, help="SDK retries on rate limits and 5xx")

    replay = sub.add_parser("replay", help="print the requests rebuilt from a session log")
    replay.add_argument("session")
    replay.add_argument("--provider", choices=PROVIDERS, help="render for this provider (default: the session's)")
    replay.add_argument("--log-dir", help="JSONL log directory (default: $TOOLCHORD_LOG_DIR or Redis when distributed)")
    replay.add_argument("--redis-url", help="read the Redis Streams log at this URL")

    approvals = sub.add_parser("approvals", help="list, approve or deny calls waiting for a decision")
    decide = approvals.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = decide.add_parser("list", help="calls waiting for a decision (overdue ones are expired)")
    listing.add_argument("--session", help="only this session's calls")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    for action in ("approve", "deny"):
        one = decide.add_parser(action, help=f"{action} a waiting call")
        one.add_argument("session")
        one.add_argument("call_id")
        one.add_argument("--by", required=True, help="who decides (recorded in the session log)")
        one.add_argument("--note", help="why (a denial's note is the reason the model reads)")

    ui = sub.add_parser("ui", help="serve the session timeline page (loopback unless authenticated)")
    ui.add_argument("--address", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=5556)
    ui.add_argument("--basic-auth", help="user:password (prefer TOOLCHORD_UI_BASIC_AUTH or TOOLCHORD_UI_BASIC_AUTH_FILE)")
    ui.add_argument("--redis-url", help="Redis with the event log, turns and call timings (default: the configured one)")
    ui.add_argument("--log-dir", help="read a JSONL event log directory instead (embedded runs: no call timings)")

    tools = sub.add_parser("tools", help="print the tool declarations for a provider")
    tools.add_argument("--provider", choices=PROVIDERS, default="chat")
    tools.add_argument("--tools", help="comma-separated tool modules (default: $TOOLCHORD_TOOL_MODULES or the demo tools)")

    limits = sub.add_parser("limits", help="the fleet-wide limits the tools declare and their use now (from Redis)")
    limits.add_argument("--tools", help="comma-separated tool modules (default: $TOOLCHORD_TOOL_MODULES or the demo tools)")
    limits.add_argument("--redis-url", help="Redis holding the limits (default: the configured one)")
    limits.add_argument("--json", action="store_true", help="one JSON object per line")

    mcp = sub.add_parser("mcp", help="Model Context Protocol: `toolchord mcp serve` exposes the tools as an MCP server")
    mcp_sub = mcp.add_subparsers(dest="mcp_command", metavar="MCP_COMMAND", required=True)
    serve = mcp_sub.add_parser("serve", help="serve the tools over MCP; calls run on the fleet (or embedded)")
    serve.add_argument("--tools", help="comma-separated tool modules (default: $TOOLCHORD_TOOL_MODULES or the demo tools)")
    serve.add_argument("--transport", choices=("stdio", "streamable-http"), default="stdio")
    serve.add_argument("--host", default="127.0.0.1", help="streamable-http: loopback addresses only")
    serve.add_argument("--port", type=int, default=8000, help="streamable-http port")
    serve.add_argument("--name", default="toolchord", help="the MCP server name")
    serve.add_argument("--turn-timeout", type=float, help="seconds a call may take in all (default: from the tool)")
    return parser


def _demo(args: argparse.Namespace) -> int:
    from toolchord.orchestrator.demo import run_demo
    from toolchord.orchestrator.stores import open_event_log

    log = open_event_log(log_dir=args.log_dir) if args.log_dir else open_event_log()
    return run_demo(provider=args.provider, stream=args.stream, log=log)


def _run(args: argparse.Namespace) -> int:
    from toolchord.orchestrator.agent import Agent
    from toolchord.orchestrator.demo import Timeline
    from toolchord.orchestrator.model_clients import ModelError

    registry = _registry(args.tools)
    with Agent(registry, model=args.model, provider=args.provider, base_url=args.base_url, system=args.system,
               max_steps=args.max_steps, stream=args.stream, max_retries=args.max_retries,
               on_step=Timeline(registry)) as agent:
        try:
            result = agent.run(args.prompt, session_id=args.session)
        except ModelError as exc:
            print(f"toolchord run: {exc}", file=sys.stderr)
            return 1
    print(f"final answer: {result.text}" if result.stop_reason == "final" else
          f"stopped after {len(result.steps)} model calls (--max-steps)")
    print(f"session {result.session_id}")
    return 0 if result.stop_reason == "final" else 3


def _replay(args: argparse.Namespace) -> int:
    from toolchord.orchestrator.approvals import turns_awaiting
    from toolchord.orchestrator.events import ModelRequest
    from toolchord.orchestrator.history_repair import History, plan_repair
    from toolchord.orchestrator.request_builder import render, request_bytes, request_digest
    from toolchord.orchestrator.stores import open_event_log

    log = open_event_log(redis_url=args.redis_url, log_dir=args.log_dir)
    events = log.read(args.session)
    if not events:
        print(f"toolchord replay: no events for session {args.session!r}", file=sys.stderr)
        return 1
    waiting = turns_awaiting(events)
    points = [i for i, e in enumerate(events) if isinstance(e, ModelRequest)] + ([] if waiting else [len(events)])
    shown = 0
    for number, end in enumerate(points, start=1):
        _print_approvals(events[shown:end])
        shown = end
        prefix = events[:end]
        history = History.from_events(prefix + plan_repair(History.from_events(prefix)))
        request, _ = render(history, args.provider)
        sent = events[end] if end < len(events) else None
        if isinstance(sent, ModelRequest):
            same = "identical to" if request_digest(request) == sent.request_digest else "DIFFERS from"
            note = f"step {sent.step}, {same} the request sent" if args.provider in (None, sent.provider) else \
                f"step {sent.step}, rendered for {args.provider}"
        else:
            note = "the next request"
        print(f"--- request {number} ({note}) ---")
        print(request_bytes(request).decode())
    _print_approvals(events[shown:])
    if waiting:
        print("--- no next request yet: calls wait for a decision (toolchord approvals list) ---")
    return 0


def _print_approvals(events: list[Any]) -> None:
    """One line per approval request and decision (who, when, what) among `events`."""
    from datetime import UTC, datetime

    from toolchord.orchestrator.events import ApprovalDecided, ApprovalRequested

    for event in events:
        if isinstance(event, ApprovalRequested):
            print(f"--- approval requested: call {event.call_id} ({event.tool}) "
                  f"{json.dumps(event.arguments, ensure_ascii=False)} ---")
        elif isinstance(event, ApprovalDecided):
            when = datetime.fromtimestamp(event.decided_at, UTC).isoformat(timespec="seconds")
            note = f": {event.note}" if event.note else ""
            print(f"--- approval {event.decision}: call {event.call_id} ({event.tool}) by {event.by} "
                  f"at {when}{note} ---")


def _approvals(args: argparse.Namespace) -> int:
    import time

    from toolchord.orchestrator.approvals import UnknownApproval
    from toolchord.orchestrator.runtime import Orchestrator
    from toolchord.worker.config import Settings

    settings = Settings.from_env()
    if settings.embedded:
        print("toolchord approvals: set TOOLCHORD_BROKER_URL and TOOLCHORD_REDIS_URL (approvals live in Redis)",
              file=sys.stderr)
        return 2
    orchestrator = Orchestrator(Registry(), settings=settings)
    if args.action == "list":
        for approval in orchestrator.pending_approvals(args.session):
            if args.json:
                print(json.dumps(approval.public(), ensure_ascii=False))
                continue
            left = approval.expires_at - time.time()
            print(f"{approval.session_id} {approval.call.id} {approval.tool}"
                  f"({json.dumps(approval.arguments, ensure_ascii=False)}) expires in {left:.0f} s")
        return 0
    decide = orchestrator.approve if args.action == "approve" else orchestrator.deny
    try:
        approval = decide(args.session, args.call_id, by=args.by, note=args.note)
    except UnknownApproval as exc:
        print(f"toolchord approvals: {exc.args[0]}", file=sys.stderr)
        return 1
    print(f"{approval.session_id} {approval.call.id} {approval.tool}: {approval.state} by {approval.decided_by}")
    return 0 if approval.state == {"approve": "APPROVED", "deny": "DENIED"}[args.action] else 3

def _ui(args: argparse.Namespace) -> int:
    from toolchord.orchestrator.stores import open_event_log
    from toolchord.orchestrator.ui import AUTH_ENV, TimelineServer
    from toolchord.worker.config import ConfigError, Settings
    from toolchord.worker.launch import basic_auth, refuse_open_access
    from toolchord.worker.redis_clients import redis_client

    try:
        auth = basic_auth(args.basic_auth, os.environ, AUTH_ENV)
        refuse_open_access("the timeline page", args.address, bool(auth), AUTH_ENV)
        redis_url = args.redis_url or (None if args.log_dir else Settings.from_env().redis_url)
    except (ConfigError, OSError) as exc:
        print(f"toolchord ui: {exc}", file=sys.stderr)
        return 2
    log = open_event_log(redis_url=redis_url, log_dir=args.log_dir)
    # Sentinel-aware, like every other Redis client of toolchord.
    client = redis_client(redis_url, master_name=os.environ.get("TOOLCHORD_REDIS_MASTER_NAME")) if redis_url else None
    server = TimelineServer(log, client, args.address, args.port, auth)
    print(f"toolchord ui on {server.url} ({'Redis' if client else 'JSONL log, no call timings'})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _tools(args: argparse.Namespace) -> int:
    from toolchord.orchestrator.providers import declarations

    print(json.dumps(declarations(_registry(args.tools), args.provider), indent=2, ensure_ascii=False))
    return 0


def _limits(args: argparse.Namespace) -> int:
    from toolchord.worker.config import ConfigError, Settings
    from toolchord.worker.limits import RedisLimiter, declared_limits
    from toolchord.worker.redis_clients import redis_client
    from toolchord.worker.store_errors import StoreUnavailable

    try:
        redis_url = args.redis_url or Settings.from_env().redis_url
    except ConfigError as exc:
        print(f"toolchord limits: {exc}", file=sys.stderr)
        return 2
    if not redis_url:
        # Embedded, each process is its own fleet: there is nothing shared to read.
        print("toolchord limits: set TOOLCHORD_REDIS_URL or --redis-url (the limits' state lives in Redis)",
              file=sys.stderr)
        return 2
    declared = declared_limits(_registry(args.tools))
    client = redis_client(redis_url, master_name=os.environ.get("TOOLCHORD_REDIS_MASTER_NAME"))
    try:
        usage = {u.name: u for u in RedisLimiter(client).usage(list(declared))}
    except StoreUnavailable as exc:
        print(f"toolchord limits: {exc}", file=sys.stderr)
        return 1
    for name, (limit, tools) in declared.items():
        row = {"limit": name, "in_use": usage[name].in_use, "concurrency": limit.concurrency,
               "waiting": usage[name].waiting, "rate": limit.rate, "burst": limit.burst,
               "per_key": limit.key is not None, "tools": tools}
        if args.json:
            print(json.dumps(row))
            continue
        rate = f"{limit.rate} (burst {limit.burst})" if limit.rate else "-"
        print(f"{name}: in flight {usage[name].in_use}/{limit.concurrency or '-'}, waiting {usage[name].waiting}, "
              f"rate {rate}{', per key' if limit.key else ''}; tools: {', '.join(tools)}")
    return 0


def _mcp(args: argparse.Namespace) -> int:
    from toolchord.orchestrator.integrations.mcp_serve import RegistryMcpServer
    from toolchord.orchestrator.runtime import Orchestrator
    from toolchord.worker.launch import is_loopback

    if args.transport == "streamable-http" and not is_loopback(args.host):
        # The MCP server has no authentication of its own: put an authenticating proxy in front.
        print(f"toolchord mcp serve: refusing to listen on {args.host}: loopback addresses only", file=sys.stderr)
        return 2
    # Embedded without TOOLCHORD_BROKER_URL, else on the fleet: the environment decides, as for run.
    server = RegistryMcpServer(Orchestrator(_registry(args.tools), turn_timeout=args.turn_timeout), name=args.name)
    if args.transport == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host=args.host, port=args.port)
    return 0


def _passthrough(command: str, rest: list[str]) -> int:
    if command == "worker":
        from toolchord.worker.launch import run_worker

        return run_worker(rest)
    if command == "flower":
        from toolchord.worker.launch import run_flower

        return run_flower(rest)
    if not rest or rest[0] not in _BENCHES:
        print(f"usage: toolchord bench {{{','.join(_BENCHES)}}} [options]", file=sys.stderr)
        return 0 if rest[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(f"toolchord.orchestrator.bench.{rest[0]}")
    return int(module.main(rest[1:]) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `toolchord` console script; exits with the command's status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        sys.exit(_passthrough(argv[0], argv[1:]))
    args = _parser().parse_args(argv)
    handler = {"demo": _demo, "run": _run, "replay": _replay, "tools": _tools, "limits": _limits, "ui": _ui,
               "mcp": _mcp, "approvals": _approvals}[args.command]
    sys.exit(handler(args))


if __name__ == "__main__":
    main()
