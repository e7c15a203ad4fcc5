"""What `pip install toolchord` puts in site-packages: only toolchord's own top-level packages."""

from __future__ import annotations

import tomllib

from setuptools import find_packages

from orchestrator.bench.processes import ROOT


def test_only_orchestrator_and_worker_are_top_level_packages() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(where=str(ROOT), include=include)
    # A generic top-level name (such as `bench`) would collide with users' own modules.
    assert {name.split(".")[0] for name in packages} == {"orchestrator", "worker"}
    # The benchmarks still ship, so `toolchord bench ...` works from an installed package.
    assert "orchestrator.bench" in packages
