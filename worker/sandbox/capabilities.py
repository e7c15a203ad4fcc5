"""Which sandbox layers work in this process, found by trying them once (cached per process).

Every layer is probed by doing it, not by reading configuration files: a default Docker container
reports Landlock in the kernel config yet may filter its syscalls, and blocks unshare without
CAP_SYS_ADMIN. The probe forks one short-lived child that tries netns, Landlock and seccomp for
real, so a worker never claims a layer it cannot apply.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import tempfile
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from toolchord.worker.sandbox import cgroup, disk, landlock
from toolchord.worker.sandbox.profile import Layer, SandboxProfile
from toolchord.worker.sandbox.syscalls import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWPID,
    PR_SET_NO_NEW_PRIVS,
    drop_capabilities,
    load_seccomp_bpf,
    prctl,
    unshare,
    unshare_keeping_ids,
)

LAYERS: tuple[Layer, ...] = (
    "rlimits",
    "uid",
    "landlock",
    "seccomp",
    "netns",
    "cgroup",
    "disk",
    "ipc",
)

EXPECTED_LAYERS: tuple[Layer, ...] = ("rlimits", "landlock", "seccomp", "netns", "disk", "ipc")
"""Layers every deployment toolchord ships (image, compose, Kubernetes, systemd) is meant to have:
one that is off there was refused by the host or the deployment. `uid` needs a root worker and
`cgroup` a writable or delegated cgroup, so those two are only warned about."""
_NAMESPACE_FIX = (
    "allow the user, mount, network, pid and ipc namespaces to the worker (systemd: "
    "RestrictNamespaces=user mnt net pid ipc, as in the shipped unit; containers: a seccomp "
    "profile that allows unshare and clone with namespace flags; hosts: user.max_user_namespaces "
    "> 0 and no AppArmor restriction of unprivileged user namespaces)"
)
_FIXES: dict[str, str] = {
    "rlimits": "a Linux kernel with getrlimit",
    "landlock": "a kernel >= 5.13 with landlock in its LSM list (boot option lsm=...,landlock)",
    "seccomp": "install libseccomp2 (the images do) and allow seccomp filters",
    "netns": _NAMESPACE_FIX,
    "disk": _NAMESPACE_FIX,
    "ipc": _NAMESPACE_FIX,
    "pid namespace": _NAMESPACE_FIX,
}


if TYPE_CHECKING:
    from toolchord.worker.tools import ToolSpec

_lock = threading.Lock()
_cached: SandboxCapabilities | None = None
_log = logging.getLogger("toolchord.sandbox")


class LayerStatus(BaseModel):
    """Whether one layer can be applied, and why not when it cannot."""

    available: bool
    detail: str = ""


class SandboxCapabilities(BaseModel):
    """The result of probing every layer in this process."""

    rlimits: LayerStatus
    uid: LayerStatus
    landlock: LayerStatus
    seccomp: LayerStatus
    netns: LayerStatus
    cgroup: LayerStatus
    disk: LayerStatus
    ipc: LayerStatus
    landlock_abi: int = Field(default=0, description="Landlock ABI version (0: none).")
    pid_namespace: LayerStatus = Field(
        default=LayerStatus(available=True, detail="not probed"),
        description="Whether the zygote and each call can have a pid namespace of their own "
        "(not a layer a profile asks for: it keeps an unprivileged worker's calls from "
        "signalling each other, the zygote and the worker).",
    )

    def status(self, layer: Layer) -> LayerStatus:
        """The probe result of one layer."""
        return getattr(self, layer)

    def available(self) -> frozenset[Layer]:
        """Layers that can be applied here."""
        return frozenset(layer for layer in LAYERS if self.status(layer).available)

    def missing(self, layers: frozenset[Layer] | set[Layer]) -> list[Layer]:
        """Those of `layers` that cannot be applied here, in a stable order."""
        return [
            layer
            for layer in LAYERS
            if layer in layers and not self.status(layer).available
        ]


def probe() -> SandboxCapabilities:
    """Probe every layer once per process; later calls (and forked processes) reuse the answer."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = _probe()
        return _cached


def describe_layers() -> str:
    """One line for the worker start log: active layers and why the others are off."""
    caps = probe()
    parts = []
    for layer in LAYERS:
        status = caps.status(layer)
        parts.append(
            f"{layer}=on" if status.available else f"{layer}=OFF ({status.detail})"
        )
    return "sandbox layers: " + ", ".join(parts)


def log_layers(logger: logging.Logger | None = None) -> SandboxCapabilities:
    """Log the active layers (info) and each unavailable one (warning); call at worker start.

    Layers every shipped deployment is meant to have (EXPECTED_LAYERS, and the pid namespaces of
    an unprivileged worker) that this host or deployment refused are moreover listed in one
    ERROR line with the deployment fix for each."""
    log = logger or _log
    caps = probe()
    log.info(describe_layers())
    for layer in LAYERS:
        status = caps.status(layer)
        if not status.available:
            log.warning("sandbox layer %s unavailable: %s", layer, status.detail)
    refused = refused_layers(caps)
    if refused:
        log.error(
            "SANDBOX LAYERS REFUSED by this host or deployment, calls run without them: %s",
            "; ".join(
                f"{name} ({detail}) -> fix: {_FIXES[name]}" for name, detail in refused.items()
            ),
        )
    return caps


def refused_layers(caps: SandboxCapabilities) -> dict[str, str]:
    """The documented layers this host refused (the pid namespace only counts for unprivileged
    workers, which rely on it), each with why."""
    refused: dict[str, str] = {
        layer: caps.status(layer).detail
        for layer in EXPECTED_LAYERS
        if not caps.status(layer).available
    }
    if os.geteuid() != 0 and not caps.pid_namespace.available:
        refused["pid namespace"] = caps.pid_namespace.detail
    return refused


def tools_missing_required(specs: Iterable[ToolSpec]) -> dict[str, list[Layer]]:
    """Isolated tools whose `required` layers this host lacks, with those layers: every call of
    theirs would fail, so a worker that has them refuses to start."""
    caps = probe()
    missing: dict[str, list[Layer]] = {}
    for spec in specs:
        lacking = caps.missing(spec.sandbox.required)
        if spec.sandbox.isolate and lacking:
            missing[spec.name] = lacking
    return missing


def _probe() -> SandboxCapabilities:
    rlimits = LayerStatus(
        available=True, detail="CPU, address space, files, file size, processes"
    )
    try:
        resource.getrlimit(resource.RLIMIT_NPROC)
    except (OSError, ValueError) as exc:
        rlimits = LayerStatus(available=False, detail=f"getrlimit failed: {exc}")
    if os.geteuid() == 0:
        uid = LayerStatus(
            available=True, detail="worker is root; calls drop to an unprivileged uid"
        )
    else:
        uid = LayerStatus(
            available=False,
            detail=f"worker is not root (uid {os.geteuid()}); calls keep the worker's uid",
        )
    abi = 0
    try:
        abi = landlock.abi_version()
    except OSError as exc:
        landlock_status = LayerStatus(
            available=False, detail=f"landlock_create_ruleset failed: {exc}"
        )
    else:
        landlock_status = LayerStatus(
            available=abi > 0, detail=f"ABI {abi}" if abi else "not in this kernel"
        )
    try:
        from toolchord.worker.sandbox.seccomp_filter import compile_filter

        program = compile_filter(network=False)
    except Exception as exc:  # noqa: BLE001 - any failure of libseccomp means the layer is off
        program = None
        seccomp_status = LayerStatus(
            available=False, detail=f"cannot build filter: {type(exc).__name__}: {exc}"
        )
    else:
        seccomp_status = LayerStatus(available=True, detail="")
    probe_cgroup, cgroup_status = _probe_cgroup()
    mount_point = tempfile.mkdtemp(prefix="toolchord-probe-")
    try:
        trial = _try_in_child(
            abi,
            program,
            probe_cgroup.join_files if probe_cgroup is not None else (),
            mount_point,
        )
    finally:
        os.rmdir(mount_point)
        if probe_cgroup is not None:
            cgroup.release(probe_cgroup)
    if probe_cgroup is not None:
        cgroup_status = _trial_status(
            trial, "cgroup", cgroup_status.detail, "joining failed"
        )
    disk_status = _trial_status(
        trial,
        "disk",
        "a size-limited tmpfs workdir per call, in a private mount namespace",
        "per-call tmpfs failed",
    )
    if abi and not trial.get("landlock", False):
        landlock_status = LayerStatus(
            available=False,
            detail=f"ABI {abi} but restrict failed: {trial.get('landlock_error')}",
        )
    if program is not None:
        ok = bool(trial.get("seccomp", False))
        seccomp_status = LayerStatus(
            available=ok,
            detail="blocks sockets with the network off"
            if ok
            else f"load failed: {trial.get('seccomp_error')}",
        )
    netns = _trial_status(
        trial, "netns", "loopback-only network namespace", "unshare failed"
    )
    ipc = _trial_status(
        trial,
        "ipc",
        "an IPC namespace per call (SysV IPC and POSIX message queues end with the call)",
        "unshare failed (seccomp refuses SysV IPC and message queues instead)",
    )
    pid_namespace = _trial_status(
        trial, "pid_namespace", "for the zygote and each call", "unshare failed"
    )
    return SandboxCapabilities(
        rlimits=rlimits,
        uid=uid,
        landlock=landlock_status,
        seccomp=seccomp_status,
        netns=netns,
        cgroup=cgroup_status,
        disk=disk_status,
        ipc=ipc,
        landlock_abi=abi,
        pid_namespace=pid_namespace,
    )


def _trial_status(
    trial: dict[str, object], layer: str, detail: str, failure: str
) -> LayerStatus:
    """A layer the trial child applied (`detail`), or why not (`failure`: its error)."""
    if trial.get(layer):
        return LayerStatus(available=True, detail=detail)
    return LayerStatus(
        available=False, detail=f"{failure}: {trial.get(f'{layer}_error')}"
    )


def _probe_cgroup() -> tuple[cgroup.CallCgroup | None, LayerStatus]:
    """A throwaway call cgroup for the trial child to join, or why there is none."""
    try:
        found = cgroup.hierarchies()
        trial = cgroup.CallCgroup.create(found, SandboxProfile())
    except OSError as exc:
        return None, LayerStatus(available=False, detail=str(exc))
    version = found[0].version
    return trial, LayerStatus(
        available=True,
        detail=f"memory and processes counted per call (cgroup v{version})",
    )


def _try_in_child(
    abi: int, program: bytes | None, cgroup_procs: tuple[str, ...], mount_point: str
) -> dict[str, object]:
    """Apply the cgroup, a private tmpfs, netns, an IPC namespace, Landlock and seccomp in a
    throwaway child and report what held."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            report: dict[str, object] = {}
            if cgroup_procs:
                try:
                    cgroup.join(cgroup_procs)
                    report["cgroup"] = True
                except OSError as exc:
                    report["cgroup_error"] = str(exc)
            try:
                # As a call's child does: an unprivileged one owns a user namespace first.
                if os.geteuid() != 0:
                    unshare_keeping_ids(0)
                try:
                    disk.mount_workdir(mount_point, 1)
                    report["disk"] = True
                except OSError as exc:
                    report["disk_error"] = str(exc)
                for layer, flag in (
                    ("netns", CLONE_NEWNET),
                    ("ipc", CLONE_NEWIPC),
                    # As the zygote does (for the next child it forks).
                    ("pid_namespace", CLONE_NEWPID),
                ):
                    try:
                        unshare(flag)
                        report[layer] = True
                    except OSError as exc:
                        report[f"{layer}_error"] = str(exc)
                if os.geteuid() != 0:
                    drop_capabilities()
            except OSError as exc:
                for layer in ("disk", "netns", "ipc", "pid_namespace"):
                    report[f"{layer}_error"] = f"user namespace: {exc}"
            try:
                prctl(PR_SET_NO_NEW_PRIVS, 1)
            except OSError as exc:
                report["nnp_error"] = str(exc)
            if abi:
                try:
                    landlock.restrict_self(abi, landlock.LandlockPlan(confine_fs=True))
                    report["landlock"] = True
                except OSError as exc:
                    report["landlock_error"] = str(exc)
            if program is not None:
                try:
                    load_seccomp_bpf(program)
                    try:
                        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
                        report["seccomp_error"] = (
                            "filter loaded but AF_INET sockets still open"
                        )
                    except PermissionError:
                        report["seccomp"] = True
                except OSError as exc:
                    report["seccomp_error"] = str(exc)
            os.write(write_fd, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return {}
