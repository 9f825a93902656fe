"""Reading the committed benchmark rows, for the reports (:mod:`report`) and the figures (:mod:`figures`) alike: a
row's rate by its counted bytes and as a share of the memory floor, pytorch_optimizer's faster path, the machine's
title. No torch import: the rows are plain JSON."""

from __future__ import annotations

import re

COMPILED = "compiled foreach SAM"  # as contenders.COMPILED (no torch import here)


#: bytes a copy moves per byte it is counted with, as runs before the floor counted it: on a CPU the copied-to line is
#: read before it is written (write-allocate), so 12 bytes move per float32 element counted at 8
COPY_MOVED_PER_COUNTED = {"cpu": 1.5, "cuda": 1.0}
#: bytes per parameter of the base optimizer's own step (params, gradients, state in; params, state out)
BARE_STEP_BYTES = {"SGD": 20, "AdamW": 28}


def floor_gbps(row: dict) -> float:
    """The memory floor of the row's run (conftest.MemoryFloor); for runs before it was measured, the copy bandwidth
    they measured, counted by the bytes it moved."""
    return row["floor_gbps"] if "floor_gbps" in row else row["copy_gbps"] * COPY_MOVED_PER_COUNTED[row["device"]]


def counted_gbps(row: dict) -> float:
    """The row's rate by its counted bytes. Whole-step runs before the bare base step was counted at its own bytes
    counted it at the SAM step's: recounted here."""
    if row["benchmark"] == "bench_whole_step" and row["contender"].startswith("bare base step"):
        own = BARE_STEP_BYTES[row["base"]] * row["parameters"]
        return row["gbps"] * own / row["bytes_counted"]
    return row["gbps"]


def pct_floor(row: dict) -> float:
    """The row's counted-bytes rate as % of the floor: each round over the floor around it where the run paired them
    (conftest.MemoryFloor.fields), else the median round's rate over the median floor."""
    if "floor_paired" in row:
        return row["pct_floor"] * counted_gbps(row) / row["gbps"]
    return 100 * counted_gbps(row) / floor_gbps(row)


PEER_PATHS = ("pytorch_optimizer", "pytorch_optimizer, per tensor")  # as contenders.PEER_PATHS (no torch import here)


def _peers(medians: dict[str, float]) -> dict[str, float]:
    return {name: medians[name] for name in PEER_PATHS if name in medians}


def best_peer(medians: dict[str, float]) -> tuple[str | None, float | None]:
    """(name, median) of pytorch_optimizer's faster path among ``medians`` (contender -> median ms of one set and
    run), or (None, None) when it did not run. Runs before both paths were timed hold one row named
    ``pytorch_optimizer``: the per-tensor path in the SAM-step benchmark, ``foreach=True`` in the whole-step one."""
    peers = _peers(medians)
    if not peers:
        return None, None
    name = min(peers, key=peers.get)
    return name, peers[name]


def machine_title(row: dict) -> str:
    if row["gpu"]:
        return row["gpu"]
    return f"{re.sub(r'[(](R|TM)[)]', '', row['cpu']).replace(' Processor', '')}, {row['cpu_count']} cores"
