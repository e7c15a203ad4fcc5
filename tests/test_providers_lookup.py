"""get_adapter, the adapter protocol, and the shared JSON argument rules."""

from __future__ import annotations

import pytest

from toolchord.orchestrator.providers import ProviderAdapter, StreamAccumulator, get_adapter, parse_arguments
from toolchord.worker.registry import PROVIDERS


@pytest.mark.parametrize("provider", PROVIDERS)
def test_every_provider_has_an_adapter_named_after_it(provider: str) -> None:
    adapter = get_adapter(provider)  # type: ignore[arg-type]
    assert adapter.name == provider
    assert isinstance(adapter, ProviderAdapter)
    first, second = adapter.stream_accumulator(), adapter.stream_accumulator()
    assert isinstance(first, StreamAccumulator)
    assert first is not second
    assert adapter.result_items([]) == []


def test_unknown_provider_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown provider 'gemini'"):
        get_adapter("gemini")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        (' {"a": [null, true]} ', {"a": [None, True]}),
        ("{}", {}),
        ('{"a": NaN}', None),
        ('{"a": Infinity}', None),
        ("[1]", None),
        ("1", None),
        ("null", None),
        ("", {}),
        (" \n", {}),
        ('{"a": "\\ud800"}', None),
        ('{"a": 1', None),
        ("[" * 100_000, None),
    ],
)
def test_parse_arguments_accepts_only_strict_json_objects(raw: str, expected: object) -> None:
    assert parse_arguments(raw) == expected
