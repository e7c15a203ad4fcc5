"""A per-call disk quota: the workdir is a tmpfs of `disk_mb`, mounted in a mount namespace of
the call's own.

RLIMIT_FSIZE bounds one file, not the total a handler writes. A root worker's child (before it
drops its uid) unshares its mount namespace, makes every mount in it private (nothing propagates
back to the host) and mounts a tmpfs with `size=` on its workdir. Only the call's processes see
that tmpfs; it disappears with the last of them, so what the call wrote never reaches the host's
disk and needs no removal. tmpfs pages are memory: with the cgroup layer they count against the
call's `memory_mb` too.

The same namespace hides the worker's secrets: an empty read-only tmpfs is mounted over the
directories deployments put them in (`/run/secrets`, `/var/run/secrets`, systemd's credentials)
and over the directory of every `*_FILE` setting of the worker, so that even a call with
`filesystem="open"` cannot read them, whatever their file modes. A `*_FILE` whose directory
cannot be hidden (it holds the workdir or the interpreter, e.g. the system temporary directory,
or it is `/`) has the file itself covered by `/dev/null`.
"""

from __future__ import annotations

import functools
import os
import sys

from toolchord.worker.sandbox.syscalls import (
    CLONE_NEWNS,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    mount,
    unshare,
)

SECRET_DIRECTORIES: tuple[str, ...] = ("/run/secrets", "/var/run/secrets", "/run/credentials")
"""Where Docker, Kubernetes and systemd put secret files; hidden from calls when they exist."""


def secret_directories(workdir: str) -> tuple[str, ...]:
    """Existing paths to hide from a call: SECRET_DIRECTORIES, `$CREDENTIALS_DIRECTORY` and the
    directory of every `*_FILE` variable of this process, except any that holds the workdir or
    the interpreter (hiding those would break the call): then the `*_FILE` file itself."""
    # Read again for every spare (a secret directory created later is hidden from the next call),
    # each distinct path once: several `*_FILE` settings often name one file (a CA bundle).
    secret_files = list(dict.fromkeys(
        value for name, value in os.environ.items() if name.endswith("_FILE") and os.path.isabs(value)
    ))
    candidates = dict.fromkeys((
        *SECRET_DIRECTORIES, os.environ.get("CREDENTIALS_DIRECTORY", ""),
        *(os.path.dirname(value) for value in secret_files),
    ))
    needed = [os.path.realpath(workdir), *_interpreter_paths()]
    found: list[str] = []
    for candidate in candidates:
        if not candidate or not os.path.isdir(candidate):
            continue
        real = os.path.realpath(candidate)
        if real == "/" or real in found:
            continue
        if any(path == real or path.startswith(real + "/") for path in needed):
            continue
        found.append(real)
    for value in secret_files:
        real = os.path.realpath(value)
        covered = any(real.startswith(directory + "/") for directory in found)
        if os.path.isfile(real) and not covered and real not in found:
            found.append(real)
    return tuple(found)


@functools.cache
def _interpreter_paths() -> tuple[str, ...]:
    # Resolved once per process: the interpreter does not move while the worker runs, and each
    # realpath costs a stat per path component on every spare's preparation.
    return tuple(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix))


def mount_workdir(path: str, size_mb: int, hidden: tuple[str, ...] = ()) -> None:
    """In the child: a private mount namespace with a `size_mb` tmpfs on `path` (mode 0700), an
    empty read-only tmpfs over each directory of `hidden` and `/dev/null` over each file."""
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=0700")
    for hidden_path in hidden:
        if not os.path.isdir(hidden_path):
            mount("/dev/null", hidden_path, None, MS_BIND)
            continue
        mount(
            "tmpfs",
            hidden_path,
            "tmpfs",
            MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
            "size=4k,mode=0555",
        )
