"""How much memory this process holds and may still take: resident set size, and what the machine or the job allows.

Linux only in detail (``/proc``, cgroups); elsewhere the functions answer ``None`` and the callers skip the check.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["rss_bytes", "peak_rss_bytes", "available_bytes", "device_memory_bytes"]


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """This process's resident set size now (``VmRSS``), or ``None`` where ``/proc`` is absent."""
    return _status_kib("VmRSS")


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size so far (``VmHWM``)."""
    return _status_kib("VmHWM")


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read_int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    return None


def _cgroup_headroom() -> int | None:
    """Memory this process's cgroup may still take (a SLURM job's ``--mem``, a container's limit), if it has one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2
            base = Path("/sys/fs/cgroup") / rel
            limit, usage = _read_int(base / "memory.max"), _read_int(base / "memory.current")
        elif "memory" in controllers.split(","):  # cgroup v1
            base = Path("/sys/fs/cgroup/memory") / rel
            limit = _read_int(base / "memory.limit_in_bytes")
            usage = _read_int(base / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes "no limit" as a huge number
            return max(0, limit - usage)
    return None


def available_bytes() -> int | None:
    """Memory this process can still take: the machine's ``MemAvailable``, or less when its cgroup (a SLURM job, a
    container) has a lower limit; ``None`` when neither can be read."""
    values = [v for v in (_meminfo_available(), _cgroup_headroom()) if v is not None]
    return min(values) if values else None


def device_memory_bytes(device: str) -> int | None:
    """Memory a training on ``device`` may take: a CUDA device's free memory (``torch.cuda.mem_get_info``), the host's
    :func:`available_bytes` for ``cpu``; ``None`` for another device or a CUDA device torch does not see."""
    kind = str(device).split(":", 1)[0]
    if kind == "cpu":
        return available_bytes()
    if kind != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
