"""The tools of examples/langgraph_example.py, in a module of their own.

A tool module importable by name lets the sandbox zygote import it once and fork each call from
there; tools defined in a script's `__main__` run in a direct fork of the worker instead.
"""

from __future__ import annotations

import time

from toolchord import Registry, tool


@tool(side_effect="read", timeout=5)
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f"sunny and 21 C in {city}"


@tool(side_effect="read", timeout=0.5, max_retries=0)
def forecast(city: str, days: int) -> str:
    """A slow forecast service (it always overruns its half-second limit here)."""
    time.sleep(days)
    return f"{days}-day forecast for {city}"


@tool(side_effect="unsafe", timeout=10)
def book_table(restaurant: str, people: int) -> str:
    """Book a table (an unsafe side effect: never run twice)."""
    return f"booked {restaurant} for {people}"


REGISTRY = Registry([get_weather, forecast, book_table])
