"""Example tools for `toolchord demo`: one of each side-effect class, and one that times out.

- `lookup_order` (read): reads an order's item and status from a small in-module catalogue (no
  address: each call runs in its own sandboxed process, so the demo keeps no state between calls
  and an address read back would contradict the update).
- `set_shipping_address` (idempotent): an upsert; repeating it with the same key is harmless.
- `send_email` (unsafe): would send mail; here it only reports what it would send.
- `slow_report` (read, 1 s timeout): sleeps past its limit to show TIMEOUT.
"""

from __future__ import annotations

import time

from toolchord.worker.context import ToolContext
from toolchord.worker.registry import Registry

registry = Registry()

_ORDERS = {
    "A-1001": {"order_id": "A-1001", "item": "espresso machine", "status": "shipped"},
    "A-1002": {"order_id": "A-1002", "item": "coffee grinder", "status": "processing"},
}


@registry.tool(side_effect="read", timeout=5)
def lookup_order(order_id: str) -> dict[str, str]:
    """Look up an order by id (e.g. "A-1001"): item and status."""
    if order_id not in _ORDERS:
        raise KeyError(f"no order {order_id!r}; known orders: {', '.join(_ORDERS)}")
    return _ORDERS[order_id]


@registry.tool(side_effect="idempotent", timeout=5)
def set_shipping_address(order_id: str, address: str) -> str:
    """Set the shipping address of an order that has not shipped yet (repeating it is harmless)."""
    return f"order {order_id}: shipping address set to {address!r}"


@registry.tool(side_effect="unsafe", timeout=5, store_raw_arguments=False)
def send_email(to: str, subject: str, body: str, context: ToolContext) -> str:
    """Send an email to a customer. Sending twice sends two emails, so it is never retried blindly."""
    return f"email to {to} queued with subject {subject!r} (idempotency key {context.idempotency_key[:12]}…)"


@registry.tool(side_effect="read", timeout=1)
def slow_report(days: int = 30) -> str:
    """Build a sales report for the last `days` days (slow: it takes longer than its 1 s limit)."""
    time.sleep(5)
    return f"report for {days} days"


__all__ = ["lookup_order", "registry", "send_email", "set_shipping_address", "slow_report"]
