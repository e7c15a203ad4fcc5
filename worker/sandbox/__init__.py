"""Sandboxed execution of handlers.

`toolchord.worker.tools` imports the profile from here while `runner` imports `toolchord.worker.tools`, so the runner
and probe names are loaded on first access (PEP 562) to keep that import cycle from biting.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from toolchord.worker.sandbox.profile import Layer, SandboxProfile

if TYPE_CHECKING:
    from toolchord.worker.sandbox.capabilities import (
        LayerStatus,
        SandboxCapabilities,
        describe_layers,
        log_layers,
        probe,
    )
    from toolchord.worker.sandbox.runner import release_before_exit, run_isolated
    from toolchord.worker.sandbox.zygote import start_zygote, stop_zygote, zygote_pid

_LAZY = {
    "LayerStatus": "toolchord.worker.sandbox.capabilities",
    "SandboxCapabilities": "toolchord.worker.sandbox.capabilities",
    "describe_layers": "toolchord.worker.sandbox.capabilities",
    "log_layers": "toolchord.worker.sandbox.capabilities",
    "probe": "toolchord.worker.sandbox.capabilities",
    "release_before_exit": "toolchord.worker.sandbox.runner",
    "run_isolated": "toolchord.worker.sandbox.runner",
    "start_zygote": "toolchord.worker.sandbox.zygote",
    "stop_zygote": "toolchord.worker.sandbox.zygote",
    "zygote_pid": "toolchord.worker.sandbox.zygote",
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
    "release_before_exit",
    "run_isolated",
    "start_zygote",
    "stop_zygote",
    "zygote_pid",
]
