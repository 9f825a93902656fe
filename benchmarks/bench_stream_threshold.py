"""The stream threshold of the ``cpp`` CPU kernels (``csrc/cpu/stream.h``) measured: the whole step (``first_step`` +
``second_step``, the base step fused) with the threshold the kernels read from this machine, a core's private cache,
against the same step with ``GEARSAM_STREAM_THRESHOLD_BYTES`` set to the last-level cache's size (where the kernels
drew the line before) or to any other value given.

The threshold is read once per process, so each measurement is a child process: one set of float32 parameters in 20
tensors with a gradient on each, SGD (momentum 0.9) or AdamW (weight decay 0.01), warm-up steps, then timed steps
(median). The settings of one size and base optimizer run one after another, a round at a time, the order turned
each round; a row gives each setting's best median over the rounds and their ratio. Every child prints the float64
sum of its weights after the same steps: a row whose settings disagree fails (a threshold decides how bytes move, not
which; the kernels' tests check the bits).

    python benchmarks/bench_stream_threshold.py [--quick] [--against BYTES ...] [--report PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

#: one measurement, run in a child process: prints {"ms": median step in ms, "checksum": sum of the weights}
CHILD = """
import json, statistics, sys, time
import torch
from gearsam_fused import SAM
n, base, warm_up, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(n // 20)) for _ in range(20)]
for p in params:
    p.grad = torch.randn_like(p)
if base == "SGD":
    opt = SAM(params, torch.optim.SGD, rho=0.05, backend="cpp", lr=1e-3, momentum=0.9)
else:
    opt = SAM(params, torch.optim.AdamW, rho=0.05, backend="cpp", lr=1e-3, weight_decay=0.01)
times = []
for i in range(warm_up + steps):
    start = time.perf_counter()
    opt.first_step()
    opt.second_step()
    times.append(time.perf_counter() - start)
with torch.no_grad():
    checksum = sum(float(p.double().sum()) for p in params)
print(json.dumps({"ms": statistics.median(times[warm_up:]) * 1e3, "checksum": checksum}))
"""

SIZES = [250_000, 1_000_000, 4_000_000, 16_000_000, 50_000_000]
QUICK_SIZES = [100_000]


def cache_bytes(level: int | None) -> int | None:
    """The size of cpu0's data or unified cache of ``level`` (None: the highest level), None where sysfs gives none."""
    from gearsam_fused.machine import cpu_caches  # imports torch: only when a run starts

    caches = cpu_caches()
    return caches.get(max(caches) if level is None and caches else level)


def measure(n: int, base: str, threshold: int | None, warm_up: int, steps: int) -> dict:
    """One child's median step (ms) and checksum, with the kernels' own threshold (None) or ``threshold`` bytes."""
    env = {k: v for k, v in os.environ.items() if k != "GEARSAM_STREAM_THRESHOLD_BYTES"}
    if threshold is not None:
        env["GEARSAM_STREAM_THRESHOLD_BYTES"] = str(threshold)
    env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(n), base, str(warm_up), str(steps)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the step of {n} parameters, {base}, threshold {threshold} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(sizes: list[int], settings: dict[str, int | None], rounds: int, warm_up: int, steps: int) -> list[dict]:
    """Rows of {parameters, base, ms: {setting: best median}}; raises where settings give different weights."""
    rows = []
    for n in sizes:
        for base in ("SGD", "AdamW"):
            medians: dict[str, list[float]] = {name: [] for name in settings}
            checksums = set()
            for r in range(rounds):
                for name in list(settings)[:: 1 if r % 2 == 0 else -1]:
                    out = measure(n, base, settings[name], warm_up, steps)
                    medians[name].append(out["ms"])
                    checksums.add(out["checksum"])
            if len(checksums) != 1:
                raise AssertionError(f"{n} parameters, {base}: the settings' weights differ: {sorted(checksums)}")
            rows.append({"parameters": n, "base": base, "ms": {k: min(v) for k, v in medians.items()}})
            print(rows[-1], flush=True)
    return rows


def render(rows: list[dict], settings: dict[str, int | None], machine: dict, rounds: int, steps: int) -> str:
    names = list(settings)
    first = names[0]
    head = " | ".join(f"{name} ms" for name in names)
    ratios = " | ".join(f"{first} / {name}" for name in names[1:])
    lines = [
        f"Measured on CPU {machine['cpu']} ({machine['cpu_count']} cores), {machine['date']}, commit "
        f"{machine['commit']}, torch {machine['torch']}, transparent huge pages {machine['huge_pages']}. Private "
        f"(level-2) cache {fmt_bytes(cache_bytes(2))}, last-level cache {fmt_bytes(cache_bytes(None))} (sysfs). "
        f"Whole step of the `cpp` backend, SAM with the base step fused; each setting's best median of {steps} "
        f"steps over {rounds} rounds, each measurement its own process.",
        "",
        f"| parameters | base | {head} | {ratios} |",
        "|---:|---|" + "---:|" * (len(names) * 2 - 1),
    ]
    for row in rows:
        ms = row["ms"]
        cells = " | ".join(f"{ms[name]:.2f}" for name in names)
        ratio = " | ".join(f"{ms[first] / ms[name]:.2f}x" for name in names[1:])
        lines.append(f"| {row['parameters'] / 1e6:g}M | {row['base']} | {cells} | {ratio} |")
    return "\n".join(lines) + "\n"


def fmt_bytes(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:g} MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small set, one round of two steps: a smoke run")
    parser.add_argument("--against", type=int, nargs="*", help="thresholds in bytes (default: the last-level cache)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--report", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)

    from gearsam_fused.backends.cpp_backend import cpp_stream_threshold_bytes
    from gearsam_fused.machine import describe_machine

    own = cpp_stream_threshold_bytes()
    if own is None or own < 0:
        sys.exit("the cpp extension is not built, or this CPU has no non-temporal stores: nothing to compare")
    against = args.against if args.against is not None else [cache_bytes(None) or 32 << 20]
    settings: dict[str, int | None] = {f"own ({fmt_bytes(own)})": None}
    settings.update({f"at {fmt_bytes(b)}": b for b in against})
    rounds, warm_up, steps = (1, 1, 2) if args.quick else (args.rounds, 3, 15)
    rows = run(QUICK_SIZES if args.quick else SIZES, settings, rounds, warm_up, steps)
    table = render(rows, settings, describe_machine("cpu", checkout=HERE), rounds, steps)
    print(table)
    if args.report:
        args.report.write_text(table)


if __name__ == "__main__":
    main()
