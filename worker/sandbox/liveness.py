"""Whether the worker process that made a sandbox resource (a workdir, a call cgroup) still runs:
what a dead one left behind is removed by the next worker process."""

from __future__ import annotations

from pathlib import Path


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this pid namespace runs. A zombie does not: a killed worker's pool
    processes wait as zombies until whoever adopted them reaps them. True when /proc cannot tell."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")
