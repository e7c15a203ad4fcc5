"""The registry: the single source of truth for which tools exist and their provider-neutral declarations.

Rendering a declaration in a provider's request format is the adapters' job
(`toolchord.orchestrator.providers.declarations`).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

from pydantic import BaseModel

from toolchord.worker.schema import parameters_schema, strict_compatible
from toolchord.worker.tools import ToolSpec, tool

Provider = Literal["chat", "anthropic", "responses"]
PROVIDERS: tuple[Provider, ...] = ("chat", "anthropic", "responses")


class DuplicateToolError(ValueError):
    """Two tools were registered under one name."""


class Registry:
    """Tools by name: holds and looks up the tools (and their handlers, at execution time)."""

    def __init__(self, tools: Iterable[ToolSpec | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, ToolSpec] = {}
        for item in tools:
            self.add(item)

    def add(self, item: ToolSpec | Callable[..., Any]) -> ToolSpec:
        """Register a ToolSpec (or a plain function, made a tool with default policy)."""
        spec = item if isinstance(item, ToolSpec) else tool(item)
        if spec.name in self._tools:
            raise DuplicateToolError(f"a tool named {spec.name!r} is already registered")
        self._tools[spec.name] = spec
        return spec

    def tool(self, fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        """Decorator: like `toolchord.tool`, and registers the result here."""
        if fn is not None:
            return self.add(tool(fn, **options))
        return lambda func: self.add(tool(func, **options))

    def merge(self, other: Registry) -> None:
        """Add every tool of another registry (names must not clash)."""
        for spec in other:
            self.add(spec)

    def add_missing(self, tools: Iterable[ToolSpec]) -> None:
        """Add the tools whose names are not registered yet; the ones already here win."""
        for spec in tools:
            if spec.name not in self._tools:
                self.add(spec)

    @classmethod
    def from_modules(cls, modules: Iterable[str]) -> Registry:
        """Import modules and collect their tools: module-level ToolSpecs and Registry instances."""
        registry = cls()
        for module_name in modules:
            module = importlib.import_module(module_name)
            for value in vars(module).values():
                if isinstance(value, Registry):
                    registry.add_missing(value)
                elif isinstance(value, ToolSpec):
                    registry.add_missing([value])
        return registry

    def get(self, name: str) -> ToolSpec | None:
        return self._tools.get(name)

    def __getitem__(self, name: str) -> ToolSpec:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[ToolSpec]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def closest(self, name: str) -> list[str]:
        """All tool names, the ones closest to `name` first."""
        close = difflib.get_close_matches(name, self.names, n=len(self._tools), cutoff=0.0)
        return close + [n for n in self.names if n not in close]

    def neutral_declarations(self) -> list[ToolDeclaration]:
        """Provider-neutral declarations of every tool, in registration order."""
        return [tool_declaration(spec) for spec in self]


class ToolDeclaration(BaseModel):
    """A tool as declared to the model, provider-neutral (each provider adapter renders it)."""

    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool = False


def tool_declaration(spec: ToolSpec) -> ToolDeclaration:
    """The provider-neutral declaration of a tool: the one place its parameter schema is built."""
    params = parameters_schema(spec.args_model)
    return ToolDeclaration(name=spec.name, description=spec.description, parameters=params,
                           strict=strict_compatible(params))
