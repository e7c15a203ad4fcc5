"""Turning typed Python functions into tools with a policy (docs/tools.md)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from toolchord.worker.context import ToolContext
from toolchord.worker.limits import Limit, LimitKey
from toolchord.worker.models import Risk, SideEffect
from toolchord.worker.sandbox.profile import SandboxProfile

DEFAULT_TRANSIENT: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)

PriorityClass = Literal["interactive", "batch"]
"""Interactive calls are taken from the queue before batch ones (docs/flow-control.md)."""

# Shorthands of `tool(...)` for a limit of the tool's own, named after it.
_OWN_LIMIT_OPTIONS = ("concurrency", "rate", "burst", "limit_key")


class ToolSpec(BaseModel):
    """A tool: its handler, its argument model and its execution policy.

    Calling the spec calls the handler directly, so decorated functions stay usable in tests.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    name: str
    description: str
    handler: Callable[..., Any]
    args_model: type[BaseModel]
    context_param: str | None = Field(default=None, description="Name of the ToolContext parameter.")
    unpack_args: bool = Field(default=True, description="Pass fields as keyword arguments.")
    side_effect: SideEffect = "unsafe"
    timeout: float = Field(default=30.0, gt=0)
    queue: str | None = None
    resource: Callable[[dict[str, Any]], str | None] | None = None
    idempotency_key: Callable[[dict[str, Any]], str] | None = None
    idempotency_window: float = Field(default=86400.0, gt=0, description="Seconds a business key dedupes.")
    cancellable: bool = False
    risk: Risk = "low"
    sandbox: SandboxProfile = SandboxProfile()
    max_output_chars: int = Field(default=20_000, ge=200)
    reconcile: Callable[[dict[str, Any], Any], bool | None] | None = None
    transient: tuple[type[BaseException], ...] = DEFAULT_TRANSIENT
    max_retries: int = Field(default=3, ge=0)
    store_raw_arguments: bool = Field(default=True, description="Keep raw arguments in the event log.")
    approval: Literal["never", "always"] | Callable[[dict[str, Any]], bool] = Field(
        default="never", description="Whether a call waits for a person's decision (a function of the arguments).")
    approval_timeout: float = Field(default=86400.0, gt=0, description="Seconds a call may wait for its decision.")
    limits: tuple[Limit, ...] = Field(
        default=(), description="Fleet-wide limits every call of the tool counts against (docs/flow-control.md).")
    priority: PriorityClass = Field(default="interactive", description="Queue priority class of the tool's calls.")
    eager: bool | None = Field(
        default=None, description="Start calls while the message still streams; None: the side-effect class decides.")

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.handler)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.handler(*args, **kwargs)


def _description(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.strip() or fn.__name__.replace("_", " ")


def _args_model_from_signature(fn: Callable[..., Any], name: str) -> tuple[type[BaseModel], str | None]:
    """Build a pydantic model from the handler's parameters, skipping the ToolContext one."""
    hints = get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    context_param: str | None = None
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name!r}: *args/**kwargs cannot be described to a model")
        annotation = hints.get(param.name, Any)
        if annotation is ToolContext:
            context_param = param.name
            continue
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (annotation, default)
    model_name = "".join(part.capitalize() for part in name.split("_")) + "Args"
    model = create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)
    return model, context_param


def _context_param_for_model(fn: Callable[..., Any]) -> str | None:
    hints = get_type_hints(fn)
    return next((p for p, t in hints.items() if t is ToolContext), None)


def _model_param(fn: Callable[..., Any]) -> type[BaseModel] | None:
    """A handler with exactly one non-context parameter typed as a pydantic model takes it whole."""
    hints = get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters if hints.get(p) is not ToolContext]
    if len(params) == 1:
        hint = hints.get(params[0])
        if isinstance(hint, type) and issubclass(hint, BaseModel):
            return hint
    return None


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    args_model: type[BaseModel] | None = None,
    **policy: Any,
) -> Any:
    """Make a tool from a typed function; usable bare (`@tool`) or with options (`@tool(side_effect="read")`).

    The argument model comes from the signature (or `args_model`, or a single pydantic-model
    parameter), the description from the docstring. `policy` takes the ToolSpec fields
    (side_effect, timeout, queue, resource, idempotency_key, cancellable, risk, sandbox,
    max_output_chars, reconcile, transient, max_retries, approval, approval_timeout, limits, priority,
    eager, ...), and `concurrency`, `rate`, `burst`, `limit_key` as shorthand for a limit of the tool's own.
    Unknown options are an error.
    """

    def build(func: Callable[..., Any]) -> ToolSpec:
        tool_name = name or func.__name__
        whole = _model_param(func)
        explicit = args_model or whole
        if explicit is not None:
            model, context_param, unpack = explicit, _context_param_for_model(func), whole is None
        else:
            model, context_param = _args_model_from_signature(func, tool_name)
            unpack = True
        unknown = set(policy) - set(ToolSpec.model_fields) - set(_OWN_LIMIT_OPTIONS)
        if unknown:
            raise TypeError(f"tool {tool_name!r}: unknown policy option(s) {sorted(unknown)}")
        options = dict(policy)
        options["limits"] = _limits(tool_name, options)
        return ToolSpec(
            name=tool_name,
            description=description or _description(func),
            handler=func,
            args_model=model,
            context_param=context_param,
            unpack_args=unpack,
            **options,
        )

    if fn is not None:
        return build(fn)
    return build


def _limits(tool_name: str, options: dict[str, Any]) -> tuple[Limit, ...]:
    """`limits=` (one Limit or several) plus the limit the shorthands `concurrency=`, `rate=`,
    `burst=`, `limit_key=` declare, named after the tool; the shorthands are taken out of `options`."""
    given = options.pop("limits", ())
    limits = [given] if isinstance(given, Limit) else list(given)
    own = {name: options.pop(name) for name in _OWN_LIMIT_OPTIONS if name in options}
    if own:
        key: LimitKey | None = own.pop("limit_key", None)
        limits.append(Limit(name=tool_name, key=key, **own))
    names = [limit.name for limit in limits]
    if len(set(names)) != len(names):
        raise TypeError(f"tool {tool_name!r}: two limits named alike in {names}")
    return tuple(limits)


def handler_kwargs(spec: ToolSpec, args: BaseModel, context: ToolContext) -> dict[str, Any]:
    """Keyword arguments for calling the handler with validated args and its context."""
    if spec.unpack_args:
        kwargs: dict[str, Any] = {field: getattr(args, field) for field in type(args).model_fields}
    else:
        model_param = next(
            p for p in inspect.signature(spec.handler).parameters if p != spec.context_param
        )
        kwargs = {model_param: args}
    if spec.context_param:
        kwargs[spec.context_param] = context
    return kwargs


__all__ = ["DEFAULT_TRANSIENT", "PriorityClass", "ToolSpec", "handler_kwargs", "tool"]
