"""Keep lazy imports working after the child drops to an unprivileged uid.

An interpreter installed under a private home (mode 700) becomes unreadable for the sandbox uid,
so `import json` inside a handler would fail once the uid changed. The worker opens each such
import root once, while it still may; the child keeps those directory descriptors and retries
lookups that fail there under `/proc/self/fd/<n>/...`. The kernel resolves those
magic links straight to the open directory, without searching the private parents again. Only
what was already importable becomes reachable, and Landlock still allows it read-only.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType

_lock = threading.Lock()
_roots: tuple[ImportRoot, ...] | None = None


@dataclass(frozen=True)
class ImportRoot:
    """An import directory unreadable for other users and a descriptor open on it."""

    path: str
    fd: int


def _readable_by_others(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return True  # nothing to rescue
    if (st.st_mode & (stat.S_IROTH | stat.S_IXOTH)) != (stat.S_IROTH | stat.S_IXOTH):
        return False
    parent = os.path.dirname(path)
    while parent and parent != "/":
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        parent = os.path.dirname(parent)
    return True


def private_import_roots() -> tuple[ImportRoot, ...]:
    """Import directories on sys.path that other users cannot read, opened once per process."""
    global _roots
    with _lock:
        if _roots is None:
            found: list[ImportRoot] = []
            for entry in dict.fromkeys(os.path.abspath(p) for p in sys.path if p):
                if os.path.isdir(entry) and not _readable_by_others(entry):
                    found.append(
                        ImportRoot(
                            entry,
                            os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC),
                        )
                    )
            _roots = tuple(found)
        return _roots


class _DescriptorPathFinder:
    """Last-resort finder: retries a failed lookup with private roots replaced by their descriptors.

    Placed at the end of sys.meta_path, it costs nothing for modules the normal finders resolve,
    and the child does not have to rewrite every package's __path__ (touching every module after
    fork would copy their memory pages and cost milliseconds per call).
    """

    def __init__(self, roots: dict[str, int]) -> None:
        self._prefixes = sorted(roots, key=len, reverse=True)
        self._roots = roots

    def _rewrite(self, path: str) -> str:
        for root in self._prefixes:
            if path == root or path.startswith(root + os.sep):
                return f"/proc/self/fd/{self._roots[root]}{path[len(root) :]}"
        return path

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        search = sys.path if path is None else path
        rewritten = [
            self._rewrite(os.path.abspath(p))
            for p in search
            if isinstance(p, str) and p
        ]
        if rewritten == list(search):
            return None
        return PathFinder.find_spec(fullname, rewritten, target)


def redirect_imports(roots: dict[str, int]) -> None:
    """In the child: let imports that fail under the private roots retry through the descriptors."""
    if roots:
        sys.meta_path.append(_DescriptorPathFinder(roots))
