"""The host's checks of a step (``gearsam_fused.host_checks``) in C++ against the same checks in Python: the eager
whole step (``first_step`` + ``second_step``, ``cpp`` backend, the base step fused) with each implementation, on the
sets where the checks are most of a step (many small tensors) and on a network's shapes.

One process. Each implementation steps its own copy of the set (same seed, same gradients), and a third copy steps
with the C++ checks again, a control: how far two copies of one setting drift apart in this process (memory
placement, the host's noise). A round times ``steps`` whole steps of each copy, one after the other, the order turned
each round; a row gives each copy's best median over the rounds, the ratios to the first, and the difference per
tensor and step. After the last round the copies' weights must be equal bit for bit (the checks decide nothing about
the values; the script fails otherwise).

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


#: the copies a row steps: label -> the implementation of the checks it steps with
COPIES = {"cpp": "cpp", "python": "python", "cpp, control": "cpp"}


def measure_set(key: str, base: str, copies: dict[str, str], rounds: int, warm_up: int, steps: int,
                quick: bool) -> dict:  # fmt: skip
    """One row: {set, tensors, parameters, base, ms: {label: best median}}."""
    import torch

    from gearsam_fused import SAM, host_checks

    import param_sets

    cls = torch.optim.SGD if base == "SGD" else torch.optim.AdamW
    runs = {}
    for label in copies:
        built = param_sets.build(key, "cpu", quick)  # the same seed: the same weights and gradients for each
        opt = SAM(built.model, cls, rho=0.05, backend="cpp", base_step="fused", foreach=True, **BASES[base])
        runs[label] = built, opt
    labels = list(copies)
    medians: dict[str, list[float]] = {label: [] for label in labels}
    for label, (_, opt) in runs.items():
        with host_checks.using(copies[label]):
            for _ in range(warm_up):
                whole_step(opt)
            if opt.base_step_mode != "fused":
                raise AssertionError(f"{key}, {base}: the base step is {opt.base_step_mode!r}, not fused")
    for r in range(rounds):
        for label in labels[:: 1 if r % 2 == 0 else -1]:
            with host_checks.using(copies[label]):
                medians[label].append(timed_median(runs[label][1], steps))
    weights = [torch.cat([p.detach().flatten() for p in built.model.parameters()]) for built, _ in runs.values()]
    if not all(torch.equal(weights[0], w) for w in weights[1:]):
        raise AssertionError(f"{key}, {base}: the implementations' weights differ after the same steps")
    built = runs[labels[0]][0]
    params = list(built.model.parameters())
    return {
        "set": built.name, "tensors": len(params), "parameters": sum(p.numel() for p in params), "base": base,
        "ms": {label: min(values) for label, values in medians.items()},
    }  # fmt: skip


def render(rows: list[dict], labels: list[str], machine: dict, rounds: int, steps: int) -> str:
    first, second, control = labels
    lines = [
        f"Measured on CPU {machine['cpu']} ({machine['cpu_count']} cores), {machine['date']}, commit "
        f"{machine['commit']}, torch {machine['torch']}. Whole step of the `cpp` backend, SAM with the base step "
        f"fused, the host's checks in each implementation, and a control (`{control}`: a third copy, the checks in "
        f"C++ again); each copy's best median of {steps} steps over {rounds} rounds, alternated in one process, the "
        "weights equal after them.",
        "",
        f"| set | tensors | base | checks in {first}, ms | checks in {second}, ms | {control}, ms | "
        f"{first} / {second} | {first} / {control} | {second} - {first}, µs per tensor |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ms = row["ms"]
        per_tensor = (ms[second] - ms[first]) * 1e3 / row["tensors"]
        lines.append(
            f"| {row['set']} ({row['parameters'] / 1e6:.1f}M) | {row['tensors']} | {row['base']} | {ms[first]:.3f} | "
            f"{ms[second]:.3f} | {ms[control]:.3f} | {ms[first] / ms[second]:.2f}x | {ms[first] / ms[control]:.2f}x | "
            f"{per_tensor:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small set, one round of three steps: a smoke run")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--report", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)

    from gearsam_fused import host_checks
    from gearsam_fused.machine import describe_machine

    try:
        host_checks.implementation("cpp")
    except ValueError as exc:
        sys.exit(f"nothing to compare: {exc}")
    rounds, warm_up, steps = (1, 1, 3) if args.quick else (args.rounds, 5, 20)
    rows = []
    for key in QUICK_SETS if args.quick else SETS:
        for base in BASES:
            rows.append(measure_set(key, base, COPIES, rounds, warm_up, steps, args.quick))
            print(rows[-1], flush=True)
    table = render(rows, list(COPIES), describe_machine("cpu", checkout=HERE), rounds, steps)
    print(table)
    if args.report:
        args.report.write_text(table)


if __name__ == "__main__":
    main()
