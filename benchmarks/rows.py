"""Reading the committed benchmark rows, for the reports (:mod:`report`) and the figures (:mod:`figures`) alike: a
row's rate by its counted bytes and as a share of the memory floor, pytorch_optimizer's faster path, the machine's
title. No torch import: the rows are plain JSON."""

from __future__ import annotations

import re
import statistics

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


PEER = "pytorch_optimizer"  # as contenders.PEER (no torch import here)
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


# ------------------------------------------------------------------------------ contenders stepped in turn


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``values`` (``statistics.quantiles``, inclusive method)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def ratio_stats(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """The per-round ratios ``numerator[i] / denominator[i]`` of two contenders stepped in the same rounds: their
    median, quartiles (``q1``, ``q3``) and range (``low``, ``high``)."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    q1, median, q3 = quartiles(ratios)
    return {"median": median, "q1": q1, "q3": q3, "low": min(ratios), "high": max(ratios)}


def faster_path(round_ms: dict[str, list[float]], paths: tuple[str, ...]) -> str | None:
    """Of ``paths`` (one implementation's paths, e.g. pytorch_optimizer's two or torch's ``foreach`` and ``fused``
    base steps), the one with the lowest median over the same rounds, among those that ran (None: none did)."""
    ran = [path for path in paths if path in round_ms]
    return min(ran, key=lambda path: statistics.median(round_ms[path])) if ran else None


def interleaved_fields(round_ms: dict[str, list[float]], references: dict[str, tuple[str, ...]],
                       over: dict[str, tuple[str, ...]] | None = None) -> dict[str, dict]:  # fmt: skip
    """Each contender's ratios to the references of its rounds, for contenders stepped in turn within the same rounds
    (``round_ms``: contender -> its time in each round, ms). ``references``: a label -> the paths it stands for (its
    faster one in these rounds is the reference, :func:`faster_path`); ``vs[label]`` is :func:`ratio_stats` of the
    reference's time over the contender's (above 1: the contender is faster), and ``vs_path[label]`` the path it was.
    ``over``: the same for ``over[label]``, the contender's time over the reference's (``over_path``). Returns
    contender -> those fields; a label none of whose paths ran is left out."""
    chosen = {label: faster_path(round_ms, paths) for label, paths in references.items()}
    chosen_over = {label: faster_path(round_ms, paths) for label, paths in (over or {}).items()}
    fields = {}
    for name, mine in round_ms.items():
        row: dict[str, dict] = {"vs": {}, "vs_path": {}}
        for label, path in chosen.items():
            if path is not None:
                row["vs"][label] = ratio_stats(round_ms[path], mine)
                row["vs_path"][label] = path
        if over:
            row["over"], row["over_path"] = {}, {}
            for label, path in chosen_over.items():
                if path is not None:
                    row["over"][label] = ratio_stats(mine, round_ms[path])
                    row["over_path"][label] = path
        fields[name] = row
    return fields


#: the label of a SAM-family row's ratio to its own plain variant (SAM, or GEAR-SAM for a GEAR-SAM variant)
OWN_SAM = "own SAM"


def family_fields(round_ms: dict[str, list[float]], own: dict[str, str], peer: tuple[str, ...]) -> dict[str, dict]:
    """The ratios of one SAM-family variant's rows, stepped in turn with their yardsticks within the same rounds
    (``round_ms``: step -> its time in each round, ms; ``contenders.FamilySteps``): ``vs`` against the faster of the
    peer's paths ``peer`` and ``over`` the row's own plain variant, the step ``own[row]`` (:func:`interleaved_fields`,
    each row with its own reference). Returns row -> those fields."""
    fields = {}
    for row, plain in own.items():
        mine = {name: round_ms[name] for name in (row, plain, *peer)}
        fields[row] = interleaved_fields(mine, {PEER: peer}, {OWN_SAM: (plain,)})[row]
    return fields
