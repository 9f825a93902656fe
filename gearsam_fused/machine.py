"""Where and with what something ran: the machine, the versions and the commit, as the benchmarks record them beside
every row and the ``gearsam`` application beside every training run and study. For anyone who keeps results, so
that a number is never without its machine and day."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

from .memory import huge_page_setting


def describe_machine(device: str | torch.device = "cpu", checkout: Path | None = None) -> dict:
    """Date, commit of the source checkout ``checkout`` (default: the one this package is run from, when it is one),
    CPU, GPU of ``device`` and library versions."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.device(device)
    return {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(checkout or _HERE),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "platform": platform.platform(),
        "huge_pages": huge_page_setting(),
        "cpu_caches": {f"L{level}": size for level, size in cpu_caches().items()},
    }


def cpu_caches() -> dict[int, int]:
    """The bytes of each level of cpu0's data or unified caches, by level, as Linux's sysfs gives them (``2048K``);
    empty where it gives none. Level 2 is a core's private cache on the CPUs we run on, the highest level the shared
    one: the first is the CPU kernels' stream threshold (``csrc/cpu/stream.h``), which reads the same files."""
    sizes = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = int((index / "level").read_text()), (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
            value = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1:], 0)
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and value > 0:
            sizes[level] = value
    return dict(sorted(sizes.items()))


# The package's own folder: a source checkout's commit is the one its code was run from.
_HERE = Path(__file__).resolve().parent


def git_commit(path: Path = _HERE) -> str | None:
    """Short commit of the checkout holding ``path``, with ``+changes`` when tracked files differ from it; None
    outside a checkout (or without git)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=path, capture_output=True, text=True, timeout=10)

    try:
        done = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") if done.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
