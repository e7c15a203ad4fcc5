"""Registry behaviour and provider declarations: args models from signatures, descriptions,
duplicate names, self-contained schemas, `strict`, and the SDKs' request shapes."""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Any, Literal

import pytest
from anthropic.types import ToolParam
from anthropic.types.tool_param import InputSchemaTyped
from openai.types.chat import ChatCompletionFunctionToolParam
from openai.types.responses import FunctionToolParam
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tests import pipeline_tools as t
from toolchord.orchestrator.providers import declaration, declarations
from toolchord.worker import PROVIDERS, DuplicateToolError, Registry, ToolContext, tool
from toolchord.worker.registry import Provider


class Address(BaseModel):
    street: str
    city: str = Field(description="City name.")


class Priority(str, Enum):
    LOW = "low"
    HIGH = "high"


@tool(side_effect="idempotent")
def create_contact(
    name: Annotated[str, Field(description="Full name of the contact.")],
    address: Address,
    ctx: ToolContext,
    tags: list[str],
    email: str | None = None,
    kind: Literal["person", "company"] = "person",
    priority: Priority = Priority.LOW,
    score: Annotated[int, Field(ge=0, le=10, description="0 to 10.")] = 5,
) -> str:
    """Create a contact in the address book.

    Returns the new contact's id.
    """
    return "c-1"


@tool(side_effect="read")
def all_required(city: str, when: str | None, units: Literal["metric", "imperial"]) -> str:
    """Everything required: strict mode can hold."""
    return city


class Query(BaseModel):
    """Search arguments."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="What to look for.")
    limit: int = 10
    where: Address | None = None


@tool(side_effect="read", args_model=Query)
def search(**kwargs: Any) -> str:
    return "results"


@tool(side_effect="read")
def search_whole(query: Query, ctx: ToolContext) -> str:
    return query.text


@tool(side_effect="read")
def undocumented_tool(x: int) -> int:
    return x


@tool(side_effect="read")
def with_mapping(labels: dict[str, int], anything: dict[str, Any], nested: Address) -> str:
    """Free-form mappings next to a model."""
    return "ok"


DECLARED = [create_contact, all_required, search, search_whole, undocumented_tool, with_mapping, *t.ALL_TOOLS]


# --- registry ------------------------------------------------------------------------------------


def test_duplicate_names_are_an_error() -> None:
    registry = Registry([t.read_file])
    with pytest.raises(DuplicateToolError, match="read_file"):
        registry.add(tool(lambda path: path, name="read_file"))
    with pytest.raises(DuplicateToolError):
        Registry([t.echo, t.echo])
    with pytest.raises(DuplicateToolError):
        Registry([t.echo]).merge(Registry([t.echo]))

    @registry.tool(side_effect="read")
    def unique(a: int) -> int:
        return a

    with pytest.raises(DuplicateToolError):
        registry.tool(unique.handler)
    assert registry.names == ["read_file", "unique"]


def test_signature_becomes_args_model() -> None:
    model = create_contact.args_model
    assert create_contact.context_param == "ctx"
    assert list(model.model_fields) == ["name", "address", "tags", "email", "kind", "priority", "score"]
    parsed = model.model_validate({"name": "Ada", "address": {"street": "1 Loop", "city": "X"}, "tags": []})
    assert (parsed.email, parsed.kind, parsed.priority, parsed.score) == (None, "person", Priority.LOW, 5)
    assert isinstance(parsed.address, Address)
    assert model.model_fields["name"].description == "Full name of the contact."
    with pytest.raises(ValidationError):
        model.model_validate({"name": "Ada", "address": {"street": "1"}, "tags": []})
    with pytest.raises(ValidationError):
        model.model_validate({"name": "Ada", "address": {"street": "1", "city": "x"}, "tags": [], "kind": "robot"})
    with pytest.raises(ValidationError):
        model.model_validate({"name": "Ada", "address": {"street": "1", "city": "x"}, "tags": [], "score": 11})
    with pytest.raises(ValidationError, match="extra"):
        model.model_validate({"name": "Ada", "address": {"street": "1", "city": "x"}, "tags": [], "ctx": {}})


def test_docstring_is_the_description() -> None:
    assert create_contact.description == "Create a contact in the address book.\n\nReturns the new contact's id."
    assert undocumented_tool.description == "undocumented tool"
    assert tool(lambda: 1, name="x", description="Given.").description == "Given."


def test_explicit_model_and_whole_model_parameter() -> None:
    assert search.args_model is Query and search_whole.args_model is Query
    assert search.unpack_args and not search_whole.unpack_args
    assert search_whole.context_param == "ctx"
    assert search.description == "search"


def test_bad_tool_definitions_are_rejected() -> None:
    with pytest.raises(TypeError, match="unknown policy"):
        tool(lambda: 1, name="x", side_efect="read")
    with pytest.raises(TypeError, match=r"\*args"):
        tool(lambda *args: 1, name="y")
    with pytest.raises(ValidationError):
        tool(lambda: 1, name="z", side_effect="sometimes")


def test_defaults_are_safe() -> None:
    spec = tool(lambda: 1, name="plain")
    assert (spec.side_effect, spec.risk, spec.timeout, spec.sandbox.isolate) == ("unsafe", "low", 30.0, True)


# --- declarations --------------------------------------------------------------------------------


def _schemas(value: Any) -> list[dict[str, Any]]:
    """Every schema node (dicts) inside a parameters schema."""
    found: list[dict[str, Any]] = []
    if isinstance(value, dict):
        found.append(value)
        for key, item in value.items():
            if key == "properties":
                for sub in item.values():
                    found.extend(_schemas(sub))
            elif key not in ("enum", "const", "default", "examples"):
                found.extend(_schemas(item))
    elif isinstance(value, list):
        for item in value:
            found.extend(_schemas(item))
    return found


def _parameters(decl: dict[str, Any], provider: Provider) -> dict[str, Any]:
    if provider == "chat":
        return decl["function"]["parameters"]
    if provider == "anthropic":
        return decl["input_schema"]
    return decl["parameters"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_declarations_are_self_contained_and_closed(provider: Provider) -> None:
    registry = Registry(DECLARED)
    for decl in declarations(registry, provider):
        text = json.dumps(decl)
        assert "$ref" not in text and "$defs" not in text
        params = _parameters(decl, provider)
        assert params["type"] == "object"
        for node in _schemas(params):
            assert "title" not in node
            if node.get("type") == "object" and "properties" in node and node["properties"]:
                assert node["additionalProperties"] is False, (decl, node)
            if node.get("type") == "object" and not isinstance(node.get("additionalProperties"), dict):
                assert node.get("additionalProperties") in (False, True), (decl, node)
        assert params["additionalProperties"] is False


def test_nested_model_is_inlined_with_its_descriptions() -> None:
    params = declaration(create_contact, "chat")["function"]["parameters"]
    address = params["properties"]["address"]
    assert address["type"] == "object" and address["additionalProperties"] is False
    assert address["properties"]["city"]["description"] == "City name."
    assert set(address["required"]) == {"street", "city"}
    assert params["properties"]["name"]["description"] == "Full name of the contact."
    assert params["properties"]["priority"]["enum"] == ["low", "high"]
    assert params["properties"]["kind"]["enum"] == ["person", "company"]
    assert "ctx" not in params["properties"]
    assert set(params["required"]) == {"name", "address", "tags"}


def test_mapping_fields_keep_their_value_schema() -> None:
    # A dict field is open by nature: closing it (additionalProperties false, no properties)
    # would declare that only {} is allowed while the handler expects entries.
    params = declaration(with_mapping, "responses")["parameters"]
    assert params["properties"]["labels"]["additionalProperties"] == {"type": "integer"}
    assert params["properties"]["anything"]["additionalProperties"] is True
    assert params["properties"]["nested"]["additionalProperties"] is False
    assert declaration(with_mapping, "responses")["strict"] is False


@pytest.mark.parametrize("provider", ["chat", "responses"])
def test_strict_only_when_every_property_is_required(provider: Provider) -> None:
    def strict_of(spec: Any) -> bool:
        decl = declaration(spec, provider)
        return decl["function"]["strict"] if provider == "chat" else decl["strict"]

    assert strict_of(all_required) is True
    for spec in DECLARED:
        params = _parameters(declaration(spec, provider), provider)
        every_required = all(
            set(node.get("required", [])) == set(node["properties"])
            for node in _schemas(params)
            if node.get("type") == "object" and "properties" in node
        )
        if strict_of(spec):
            assert every_required, spec.name
    assert strict_of(create_contact) is False
    assert strict_of(t.read_file) is False
    assert strict_of(t.silent) is True


def _check_typed_dict(typed_dict: Any, value: dict[str, Any]) -> None:
    TypeAdapter(typed_dict).validate_python(value, strict=False)
    assert set(value) <= set(typed_dict.__annotations__), set(value) - set(typed_dict.__annotations__)


def test_chat_declarations_match_the_openai_param_shape() -> None:
    from openai.types.shared_params import FunctionDefinition

    for decl in declarations(Registry(DECLARED), "chat"):
        _check_typed_dict(ChatCompletionFunctionToolParam, decl)
        _check_typed_dict(FunctionDefinition, decl["function"])
        assert decl["type"] == "function" and decl["function"]["name"]


def test_responses_declarations_match_the_openai_param_shape() -> None:
    for decl in declarations(Registry(DECLARED), "responses"):
        _check_typed_dict(FunctionToolParam, decl)
        assert {"type", "name", "parameters", "strict"} <= set(decl)


def test_anthropic_declarations_have_an_object_input_schema() -> None:
    for decl in declarations(Registry(DECLARED), "anthropic"):
        _check_typed_dict(ToolParam, decl)
        TypeAdapter(InputSchemaTyped).validate_python(decl["input_schema"])
        assert decl["input_schema"]["type"] == "object"
        assert "strict" not in decl and "parameters" not in decl
