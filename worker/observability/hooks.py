"""Spans and metrics around the steps of a call on a worker: the claim, the sandbox run, the store.

`ObservedStore` wraps the idempotency store (the runtime hands it to the tasks), and
`observe_sandbox_run` wraps one handler run, so the task code itself needs no tracing calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.idempotency import Claim, IdempotencyStore
from toolchord.worker.observability.metrics import CLAIM_TAKEN, metrics
from toolchord.worker.observability.tracing import set_attributes, span
from toolchord.worker.tools import ToolSpec

# Outcomes where the sandbox ended the handler rather than the handler returning.
_KILLED = ("timeout", "crashed", "cancelled")


class ObservedStore:
    """An `IdempotencyStore` whose claims and result stores are spans and counted claims."""

    def __init__(self, inner: IdempotencyStore) -> None:
        self.inner = inner

    def claim(self, key: str, token: str, lease: float, ttl: int, cancel_scope: str | None = None, *,
              replicas: int = 0) -> Claim:
        with span("toolchord.claim") as current:
            claim = self.inner.claim(key, token, lease, ttl, cancel_scope, replicas=replicas)
            set_attributes(current, {"toolchord.claim_state": claim.state.value})
        m = metrics()
        if m is not None:
            m.claims.labels(claim.state.value, str(claim.state.value in CLAIM_TAKEN).lower()).inc()
        return claim

    def complete(self, key: str, token: str, result_json: str, ttl: int, *, provisional: bool = False,
                 replicas: int = 0) -> str:
        with span("toolchord.result_store", {"toolchord.provisional": provisional}):
            return self.inner.complete(key, token, result_json, ttl, provisional=provisional, replicas=replicas)

    def __getattr__(self, name: str) -> Any:
        # renew, release, result(s), started, cancel(led): passed through unobserved.
        return getattr(self.inner, name)


def observe_sandbox_run(spec: ToolSpec, run: Callable[[], HandlerOutcome]) -> HandlerOutcome:
    """Run one handler inside a `toolchord.sandbox.run` span; count the runs the sandbox ended."""
    with span("toolchord.sandbox.run", {"toolchord.tool": spec.name, "toolchord.isolated": spec.sandbox.isolate}) as current:
        outcome = run()
        set_attributes(current, {"toolchord.outcome": outcome.status, "toolchord.started": outcome.started})
    m = metrics()
    if m is not None and outcome.status in _KILLED:
        m.sandbox_kills.labels(spec.name, outcome.status).inc()
    return outcome


__all__ = ["ObservedStore", "observe_sandbox_run"]
