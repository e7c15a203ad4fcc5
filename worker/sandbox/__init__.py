"""Sandboxed execution of handlers.

`worker.tools` imports the profile from here while `runner` imports `worker.tools`, so the runner
and probe names are loaded on first access (PEP 562) to keep that import cycle from biting.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from worker.sandbox.profile import Layer, SandboxProfile

if TYPE_CHECKING:
    from worker.sandbox.capabilities import (
        LayerStatus,
        SandboxCapabilities,
        describe_layers,
        log_layers,
        probe,
    )
    from worker.sandbox.runner import run_isolated
    from worker.sandbox.zygote import start_zygote, stop_zygote, zygote_pid

_LAZY = {
    "LayerStatus": "worker.sandbox.capabilities",
    "SandboxCapabilities": "worker.sandbox.capabilities",
    "describe_layers": "worker.sandbox.capabilities",
    "log_layers": "worker.sandbox.capabilities",
    "probe": "worker.sandbox.capabilities",
    "run_isolated": "worker.sandbox.runner",
    "start_zygote": "worker.sandbox.zygote",
    "stop_zygote": "worker.sandbox.zygote",
    "zygote_pid": "worker.sandbox.zygote",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Layer",
    "LayerStatus",
    "SandboxCapabilities",
    "SandboxProfile",
    "describe_layers",
    "log_layers",
    "probe",
    "run_isolated",
    "start_zygote",
    "stop_zygote",
    "zygote_pid",
]
