"""Plain JSON data from SDK models and dicts, and the JSON reading rules shared by all providers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from orchestrator.providers.protocol import ProviderFormatError

# Values under these keys are the model's own data (tool arguments): a null inside them is meaningful.
OPAQUE_KEYS = frozenset({"input", "arguments"})


def to_plain(value: Any) -> Any:
    """SDK models, mappings and sequences as plain JSON data (dicts, lists, scalars).

    SDK models are dumped with their own `to_dict`, which uses the API's field names and keeps only
    the fields that were received (or set), so the result is what the API sent, not the SDK defaults.
    """
    if isinstance(value, BaseModel):
        sdk_to_dict = getattr(value, "to_dict", None)
        if callable(sdk_to_dict):
            return sdk_to_dict(mode="json")
        return value.model_dump(mode="json", by_alias=True, exclude_unset=True)
    if isinstance(value, Mapping):
        return {str(key): to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    return value


def without_nulls(value: Any) -> Any:
    """A copy without null fields, which the APIs treat as absent (and some reject in requests).

    Tool arguments (keys in OPAQUE_KEYS) are copied untouched: there a null is the model's value.
    """
    if isinstance(value, dict):
        return {
            key: (item if key in OPAQUE_KEYS else without_nulls(item))
            for key, item in value.items()
            if item is not None
        }
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_arguments(raw: str) -> dict[str, Any] | None:
    """The arguments as a dict when `raw` is strict JSON for an object, else None (never raises).

    NaN and Infinity are rejected: they are not JSON, and no provider sends them.
    """
    try:
        parsed = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, TypeError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None


def compact_json(value: Any) -> str:
    """JSON text without whitespace; non-ASCII kept as is. Used for arguments that arrive as objects."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def read_arguments(value: Any) -> tuple[str, dict[str, Any] | None]:
    """(arguments_raw, arguments) for arguments that arrive as JSON text or as an object.

    Text is kept verbatim and parsed; an object is serialized compactly and used as is; a missing
    value reads as empty text (which the pipeline reports as INVALID_JSON).
    """
    if value is None:
        return "", None
    if isinstance(value, str):
        return value, parse_arguments(value)
    if isinstance(value, dict):
        return compact_json(value), value
    return compact_json(value), None


def as_mapping(value: Any, what: str) -> dict[str, Any]:
    """`value` (already plain) as a dict, or ProviderFormatError naming `what` it should have been."""
    if not isinstance(value, dict):
        raise ProviderFormatError(f"{what} must be an object, got {type(value).__name__}")
    return value


def as_list(value: Any, what: str) -> list[Any]:
    """`value` (already plain) as a list; None reads as empty."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProviderFormatError(f"{what} must be a list, got {type(value).__name__}")
    return value


def required_text(container: Mapping[str, Any], key: str, what: str) -> str:
    """A non-empty string field, or ProviderFormatError: a call without id or name cannot be answered."""
    value = container.get(key)
    if not isinstance(value, str) or not value:
        raise ProviderFormatError(f"{what} has no {key!r} (got {value!r})")
    return value


class DeltaBuffer:
    """Streamed text deltas kept as parts and joined once, when the text is read.

    `item[key] = item[key] + delta` copies the whole text at every delta: a 5 MB argument in 1 KB
    deltas would copy gigabytes. Call `flush` before reading any buffered field.
    """

    def __init__(self) -> None:
        self._pending: dict[tuple[int, str], tuple[dict[str, Any], list[str]]] = {}

    def add(self, target: dict[str, Any], key: str, delta: str) -> None:
        """Append `delta` to the text `target[key]` (missing or None reads as empty)."""
        entry = self._pending.get((id(target), key))
        if entry is None:
            entry = self._pending[(id(target), key)] = (target, [target.get(key) or ""])
        entry[1].append(delta)

    def flush(self) -> None:
        """Write every buffered text into its field."""
        for (_, key), (target, parts) in self._pending.items():
            target[key] = "".join(parts)
        self._pending.clear()


def newly_rankable(start: int, present: Mapping[int, Any], *, final: bool) -> list[int]:
    """Stream positions from `start` on whose rank among the calls is now known, in order.

    A rank is known once every earlier position has arrived: the contiguous run of present
    positions from `start` (at the end of the stream, every remaining one). Streams call this with
    `start` just past the last position ranked, so each position is looked at once.
    """
    if final:
        return sorted(index for index in present if index >= start)
    pending: list[int] = []
    while start + len(pending) in present:
        pending.append(start + len(pending))
    return pending


def check_unique_ids(ids: list[str], what: str) -> None:
    """Two calls with one id could not be paired with their results."""
    seen: set[str] = set()
    for call_id in ids:
        if call_id in seen:
            raise ProviderFormatError(f"{what}: two tool calls share the id {call_id!r}")
        seen.add(call_id)
