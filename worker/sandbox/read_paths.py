"""The paths a confined child may read: system directories, the interpreter and imported code.

Computed by the process that forks the child (the worker, or the zygote), from its own `sys.path`
and `sys.modules`: those are the files the child's code may still need to load.
"""

from __future__ import annotations

import os
import sys
import threading

SYSTEM_READ_PATHS: tuple[str, ...] = (
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/bin",
    "/sbin",
    "/etc",
)
DEVICE_PATHS: tuple[str, ...] = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
)

_lock = threading.Lock()
_cache: tuple[int, tuple[str, ...]] | None = None


def code_read_paths() -> tuple[str, ...]:
    """System directories, the interpreter prefix and the code already imported by this process.

    The current directory is not granted as a whole even when it is on sys.path (it is often the
    project root, next to configuration and .env files); the modules and packages imported from
    it are, one by one. Recomputed when new modules were imported.
    """
    global _cache
    with _lock:
        module_count = len(sys.modules)
        if _cache is None or _cache[0] != module_count:
            _cache = (module_count, _compute())
        return _cache[1]


def _compute() -> tuple[str, ...]:
    cwd = os.getcwd()
    paths = dict.fromkeys(SYSTEM_READ_PATHS)
    paths.update(dict.fromkeys((sys.prefix, sys.base_prefix, sys.exec_prefix)))
    paths.update(
        dict.fromkeys(
            p for p in (os.path.abspath(p) for p in sys.path if p) if p != cwd
        )
    )
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if not origin:
            continue
        origin = os.path.abspath(origin)
        is_package = os.path.basename(origin).startswith("__init__.")
        if "." not in name:
            # Top-level modules found through path hooks (editable installs) or the current
            # directory: a package grants its directory, a single module only its file.
            paths[os.path.dirname(origin) if is_package else origin] = None
        if is_package:
            # Landlock judges the file the kernel reaches, not the link on the way: a package
            # reached through a symbolic link (`toolchord/worker` in a source checkout) is
            # granted where it really lives.
            package_dir = os.path.dirname(origin)
            real = os.path.realpath(package_dir)
            if real != package_dir:
                paths[real] = None
    existing = sorted((p for p in paths if os.path.exists(p)), key=len)
    # A rule covers the whole subtree: nested entries only cost extra syscalls per call.
    kept: list[str] = []
    for path in existing:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return tuple(kept)
