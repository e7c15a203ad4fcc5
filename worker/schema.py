"""JSON Schema for tool parameters, in the subset every provider accepts.

Pydantic emits `$defs`/`$ref` for nested models and `title` everywhere; providers differ on what
they accept, so declarations carry a self-contained schema: references inlined, titles dropped,
`additionalProperties: false` on every model object (the args models forbid extra fields anyway).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

# Keywords OpenAI's strict mode rejects; a schema using any of them is declared non-strict.
_STRICT_UNSUPPORTED = {"default", "allOf", "not", "if", "then", "else", "dependentRequired",
                       "patternProperties", "propertyNames", "minProperties", "maxProperties"}


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:
                raise ValueError(f"recursive model {name!r} cannot be inlined for providers")
            target = copy.deepcopy(defs[name])
            extra = {k: v for k, v in node.items() if k != "$ref"}
            target.update(extra)
            return _inline(target, defs, (*seen, name))
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("$defs", "title"):
                continue
            if key == "properties" and isinstance(value, dict):
                out[key] = {prop: _inline(sub, defs, seen) for prop, sub in value.items()}
            else:
                out[key] = _inline(value, defs, seen)
        # Close model objects; a mapping field (dict[str, X]) declares its value schema in
        # additionalProperties and must stay open, or only {} would be a valid value.
        if out.get("type") == "object" and "additionalProperties" not in out:
            out.setdefault("properties", {})
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_inline(item, defs, seen) for item in node]
    return node


def parameters_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A self-contained object schema for a tool's argument model."""
    raw = model.model_json_schema()
    schema = _inline(raw, raw.get("$defs", {}), ())
    schema["type"] = "object"
    schema.setdefault("properties", {})
    schema["additionalProperties"] = False
    return schema


def strict_compatible(schema: Any) -> bool:
    """True when OpenAI strict mode accepts the schema: every property required, no banned keyword."""
    if isinstance(schema, dict):
        if _STRICT_UNSUPPORTED & schema.keys():
            return False
        if schema.get("type") == "object" or "properties" in schema:
            props = schema.get("properties", {})
            if set(schema.get("required", [])) != set(props):
                return False
            if schema.get("additionalProperties") is not False:
                return False
        return all(strict_compatible(v) for k, v in schema.items() if k not in ("enum", "const"))
    if isinstance(schema, list):
        return all(strict_compatible(v) for v in schema)
    return True
