"""The `toolchord` command line (console script `toolchord = orchestrator.cli:main`).

Subcommands: worker, flower (Celery processes, see worker.launch), demo, run, replay, tools, ui, bench.
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

from worker.registry import PROVIDERS, Registry

_PASSTHROUGH = ("worker", "flower", "bench")
_BENCHES = ("turns", "sandbox", "load")


def _registry(modules: str | None) -> Registry:
    """Tools from --tools, else TOOLCHORD_TOOL_MODULES, else the demo tools."""
    names = modules or os.environ.get("TOOLCHORD_TOOL_MODULES") or "worker.demo_tools"
    return Registry.from_modules([m.strip() for m in names.split(",") if m.strip()])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolchord", description="Execute LLM agents' tool calls on Celery.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("worker", help="start a Celery worker for the tools (options: toolchord worker --help)",
                   add_help=False)
    sub.add_parser("flower", help="start Flower on toolchord's app (options: toolchord flower --help)", add_help=False)
    sub.add_parser("bench", help=f"run a benchmark: {', '.join(_BENCHES)}", add_help=False)

    demo = sub.add_parser("demo", help="a full multi-turn conversation against a scripted model (embedded, or on the cluster when TOOLCHORD_BROKER_URL is set)")
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

    ui = sub.add_parser("ui", help="serve the session timeline page (loopback unless authenticated)")
    ui.add_argument("--address", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=5556)
    ui.add_argument("--basic-auth", help="user:password (prefer TOOLCHORD_UI_BASIC_AUTH or TOOLCHORD_UI_BASIC_AUTH_FILE)")
    ui.add_argument("--redis-url", help="Redis with the event log, turns and call timings (default: the configured one)")
    ui.add_argument("--log-dir", help="read a JSONL event log directory instead (embedded runs: no call timings)")

    tools = sub.add_parser("tools", help="print the tool declarations for a provider")
    tools.add_argument("--provider", choices=PROVIDERS, default="chat")
    tools.add_argument("--tools", help="comma-separated tool modules (default: $TOOLCHORD_TOOL_MODULES or the demo tools)")
    return parser


def _demo(args: argparse.Namespace) -> int:
    from orchestrator.demo import run_demo
    from orchestrator.eventlog import open_event_log

    log = open_event_log(log_dir=args.log_dir) if args.log_dir else open_event_log()
    return run_demo(provider=args.provider, stream=args.stream, log=log)


def _run(args: argparse.Namespace) -> int:
    from orchestrator.agent import Agent
    from orchestrator.demo import Timeline
    from orchestrator.model_clients import ModelError

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
    from orchestrator.eventlog import ModelRequest, open_event_log
    from orchestrator.history_repair import History, plan_repair
    from orchestrator.request_builder import render, request_bytes, request_digest

    log = open_event_log(redis_url=args.redis_url, log_dir=args.log_dir)
    events = log.read(args.session)
    if not events:
        print(f"toolchord replay: no events for session {args.session!r}", file=sys.stderr)
        return 1
    points = [i for i, e in enumerate(events) if isinstance(e, ModelRequest)] + [len(events)]
    for number, end in enumerate(points, start=1):
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
    return 0


def _ui(args: argparse.Namespace) -> int:
    import redis

    from orchestrator.eventlog import open_event_log
    from orchestrator.ui import AUTH_ENV, TimelineServer
    from worker.config import ConfigError, Settings
    from worker.launch import basic_auth, refuse_open_access

    try:
        auth = basic_auth(args.basic_auth, os.environ, AUTH_ENV)
        refuse_open_access("the timeline page", args.address, bool(auth), AUTH_ENV)
        redis_url = args.redis_url or (None if args.log_dir else Settings.from_env().redis_url)
    except (ConfigError, OSError) as exc:
        print(f"toolchord ui: {exc}", file=sys.stderr)
        return 2
    log = open_event_log(redis_url=redis_url, log_dir=args.log_dir)
    client = redis.Redis.from_url(redis_url) if redis_url else None
    server = TimelineServer(log, client, args.address, args.port, auth)
    print(f"toolchord ui on {server.url} ({'Redis' if client else 'JSONL log, no call timings'})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _tools(args: argparse.Namespace) -> int:
    print(json.dumps(_registry(args.tools).declarations(args.provider), indent=2, ensure_ascii=False))
    return 0


def _passthrough(command: str, rest: list[str]) -> int:
    if command == "worker":
        from worker.launch import run_worker

        return run_worker(rest)
    if command == "flower":
        from worker.launch import run_flower

        return run_flower(rest)
    if not rest or rest[0] not in _BENCHES:
        print(f"usage: toolchord bench {{{','.join(_BENCHES)}}} [options]", file=sys.stderr)
        return 0 if rest[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(f"orchestrator.bench.{rest[0]}")
    return int(module.main(rest[1:]) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `toolchord` console script; exits with the command's status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        sys.exit(_passthrough(argv[0], argv[1:]))
    args = _parser().parse_args(argv)
    handler = {"demo": _demo, "run": _run, "replay": _replay, "tools": _tools, "ui": _ui}[args.command]
    sys.exit(handler(args))


if __name__ == "__main__":
    main()
