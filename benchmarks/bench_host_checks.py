"""The host's checks of a step (``gearsam_fused.host_checks``) in C++ against the same checks in Python: the eager
whole step (``first_step`` + ``second_step``, ``cpp`` backend, the base step fused) with each implementation, on the
sets where the checks are most of a step (many small tensors) and on a network's shapes.

One process. Each implementation steps its own copy of the set (same seed, same gradients); a round times
``steps`` whole steps of each, one after the other, the order turned each round, and a row gives each one's best
median over the rounds, their ratio, and the difference per tensor and step. After the last round the two copies'
weights must be equal bit for bit (the checks decide nothing about the values; the script fails otherwise).

    python benchmarks/bench_host_checks.py [--quick] [--rounds N] [--report PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

SETS = ["small_tensors", "tensors_4096", "resnet18"]
QUICK_SETS = ["small_tensors"]
BASES = {"SGD": dict(lr=1e-3, momentum=0.9, weight_decay=5e-4), "AdamW": dict(lr=1e-3, weight_decay=0.01)}


def whole_step(opt) -> None:
    opt.first_step()
    opt.second_step()


def timed_median(opt, steps: int) -> float:
    """The median of ``steps`` whole steps of ``opt``, in ms."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        whole_step(opt)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure_set(key: str, base: str, names: list[str], rounds: int, warm_up: int, steps: int, quick: bool) -> dict:
    """One row: {set, tensors, parameters, base, ms: {implementation: best median}}."""
    import torch

    from gearsam_fused import SAM, host_checks

    import param_sets

    cls = torch.optim.SGD if base == "SGD" else torch.optim.AdamW
    runs = {}
    for name in names:
        built = param_sets.build(key, "cpu", quick)  # the same seed: the same weights and gradients for each
        opt = SAM(built.model, cls, rho=0.05, backend="cpp", base_step="fused", foreach=True, **BASES[base])
        runs[name] = built, opt
    medians: dict[str, list[float]] = {name: [] for name in names}
    for name, (_, opt) in runs.items():
        with host_checks.using(name):
            for _ in range(warm_up):
                whole_step(opt)
            if opt.base_step_mode != "fused":
                raise AssertionError(f"{key}, {base}: the base step is {opt.base_step_mode!r}, not fused")
    for r in range(rounds):
        for name in names[:: 1 if r % 2 == 0 else -1]:
            with host_checks.using(name):
                medians[name].append(timed_median(runs[name][1], steps))
    weights = [torch.cat([p.detach().flatten() for p in built.model.parameters()]) for built, _ in runs.values()]
    if not all(torch.equal(weights[0], w) for w in weights[1:]):
        raise AssertionError(f"{key}, {base}: the implementations' weights differ after the same steps")
    built = runs[names[0]][0]
    params = list(built.model.parameters())
    return {
        "set": built.name, "tensors": len(params), "parameters": sum(p.numel() for p in params), "base": base,
        "ms": {name: min(values) for name, values in medians.items()},
    }  # fmt: skip


def render(rows: list[dict], names: list[str], machine: dict, rounds: int, steps: int) -> str:
    first, second = names
    lines = [
        f"Measured on CPU {machine['cpu']} ({machine['cpu_count']} cores), {machine['date']}, commit "
        f"{machine['commit']}, torch {machine['torch']}. Whole step of the `cpp` backend, SAM with the base step "
        f"fused, the host's checks in each implementation; each one's best median of {steps} steps over {rounds} "
        "rounds, alternated in one process, the weights equal after them.",
        "",
        f"| set | tensors | base | checks in {first}, ms | checks in {second}, ms | {first} / {second} | "
        f"{second} - {first}, µs per tensor |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        ms = row["ms"]
        per_tensor = (ms[second] - ms[first]) * 1e3 / row["tensors"]
        lines.append(
            f"| {row['set']} ({row['parameters'] / 1e6:.1f}M) | {row['tensors']} | {row['base']} | {ms[first]:.3f} | "
            f"{ms[second]:.3f} | {ms[first] / ms[second]:.2f}x | {per_tensor:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small set, one round of three steps: a smoke run")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--report", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)

    from gearsam_fused import host_checks
    from gearsam_fused.app.machine import describe_machine

    try:
        host_checks.implementation("cpp")
    except ValueError as exc:
        sys.exit(f"nothing to compare: {exc}")
    names = ["cpp", "python"]
    rounds, warm_up, steps = (1, 1, 3) if args.quick else (args.rounds, 5, 20)
    rows = []
    for key in QUICK_SETS if args.quick else SETS:
        for base in BASES:
            rows.append(measure_set(key, base, names, rounds, warm_up, steps, args.quick))
            print(rows[-1], flush=True)
    table = render(rows, names, describe_machine("cpu"), rounds, steps)
    print(table)
    if args.report:
        args.report.write_text(table)


if __name__ == "__main__":
    main()
