"""A worker start under systemd's `RestrictNamespaces=user net` (the old unit), emulated the way
systemd does it: a seccomp filter that fails unshare/clone/setns with the mount or pid namespace
flags (and clone3, whose flags seccomp cannot see, with ENOSYS). For tests/test_deploy_namespaces.py.

`python -m tests.restricted_namespaces_worker probe` logs the sandbox layers as a worker does at
start; `... start` sends Celery's worker_init for an app with a tool that requires the disk layer.
"""

from __future__ import annotations

import errno
import logging
import sys

import pyseccomp as seccomp

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000


def restrict_namespaces() -> None:
    """Refuse new mount and pid namespaces from here on, for this process and its children."""
    deny = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for flag in (CLONE_NEWNS, CLONE_NEWPID):
        for name in ("unshare", "clone", "setns"):
            argument = 1 if name == "setns" else 0
            rules.add_rule(deny, name, seccomp.Arg(argument, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    rules.load()


def main(mode: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    restrict_namespaces()
    if mode == "probe":
        from toolchord.worker.sandbox import log_layers

        log_layers()
        return
    from celery.signals import worker_init

    from toolchord.worker import Registry, SandboxProfile, tool
    from toolchord.worker.celery_app import create_app
    from toolchord.worker.config import Settings

    @tool(sandbox=SandboxProfile(required=frozenset({"disk"})))
    def needs_a_disk_quota() -> str:
        """A tool that must not run without its tmpfs workdir."""
        return "ran"

    create_app(Settings(), Registry([needs_a_disk_quota]))
    worker_init.send(sender=None)
    print("started", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
