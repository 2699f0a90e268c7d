"""How much host memory is free for the engine to take: the kernel's ``MemAvailable``,
lowered to what the process's memory cgroup (a container's limit) still allows.

``MemAvailable`` (``/proc/meminfo``, Linux 3.14+) is the kernel's estimate of the memory a
new workload can take without swapping: free pages plus the page cache and reclaimable
slab it could drop. A container sees the host's meminfo, so the cgroup's own limit is
checked too: limit minus usage, where usage leaves out the inactive file cache the
kernel reclaims first (the same estimate ``docker stats`` and the kubelet make). Both
cgroup versions are read: v2 (``memory.max``, ``memory.current``, ``memory.stat``'s
``inactive_file``) on every ancestor of the process's cgroup, and v1's memory controller
(``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``total_inactive_file``).

Pure reads of a few small files; every path is a parameter so tests give their own.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_bytes", "cgroup_headroom_bytes", "meminfo_available_bytes"]


def _read_int(path: Path) -> int | None:
    """The integer in a one-line file; None when the file is missing, unreadable or says
    ``max`` (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(path: Path, name: str) -> int:
    """One field of a cgroup ``memory.stat`` file (bytes); 0 when missing."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def meminfo_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of ``meminfo`` in bytes (``MemFree`` on kernels without it); None
    when the file cannot be read (not Linux)."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0]) * 1024  # meminfo counts kB
    return fields.get("MemAvailable", fields.get("MemFree"))


def cgroup_headroom_bytes(cgroup_root: Path = Path("/sys/fs/cgroup"),
                          self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes the process's memory cgroups still allow: the smallest ``limit - usage`` (usage
    without inactive file cache) over the v2 cgroup and its ancestors and the v1 memory
    cgroup; None when no cgroup sets a limit (or none can be read).

    Args:
        cgroup_root: where the cgroup file systems are mounted.
        self_cgroup: the ``/proc/<pid>/cgroup`` file naming the process's cgroups.
    """
    try:
        entries = [line.split(":", 2) for line in self_cgroup.read_text().splitlines()]
    except OSError:
        return None
    room: list[int] = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, rel = entry
        rel = rel.strip().lstrip("/")
        if controllers == "":  # v2: the unified hierarchy; a limit may sit on any ancestor
            folder = cgroup_root / rel if rel else cgroup_root
            while True:
                limit = _read_int(folder / "memory.max")
                usage = _read_int(folder / "memory.current")
                if limit is not None and usage is not None:
                    usage -= _stat_field(folder / "memory.stat", "inactive_file")
                    room.append(max(0, limit - usage))
                if folder == cgroup_root or cgroup_root not in folder.parents:
                    break
                folder = folder.parent
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            for folder in (cgroup_root / "memory" / rel, cgroup_root / "memory"):
                # the effective limit: the lowest on the path to the root
                limit = (_stat_field(folder / "memory.stat", "hierarchical_memory_limit")
                         or _read_int(folder / "memory.limit_in_bytes"))
                usage = _read_int(folder / "memory.usage_in_bytes")
                # v1 reports "no limit" as a huge page-rounded number rather than "max".
                if limit is not None and usage is not None and limit < 1 << 60:
                    usage -= _stat_field(folder / "memory.stat", "total_inactive_file")
                    room.append(max(0, limit - usage))
                    break
    return min(room) if room else None


def available_bytes(proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Host memory free for this process to take, in bytes: ``MemAvailable``, lowered to its
    cgroups' headroom; where there is no ``/proc`` (not Linux), the physical pages the OS
    reports free (``os.sysconf``); None when nothing can be read."""
    found = [b for b in (meminfo_available_bytes(proc_root / "meminfo"),
                         cgroup_headroom_bytes(cgroup_root, proc_root / "self" / "cgroup")) if b is not None]
    if found:
        return min(found)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
