"""The host's share of a step: the eager whole step (``first_step`` + ``second_step``, ``cpp`` backend or another
with ``--backend``, the base step fused) with the optimizer state trusted once adopted, as it runs by default, against the same step with the state
checked at every step (``gearsam_fused.set_state_debug_mode(True)``) and, with ``--against DIR``, against the step of
another checkout of this repository (its extension built in place), e.g. an earlier commit, both checkouts then
stepping in worker processes of their own so that a process's own placement in memory favours neither.

On the sets where the host's work is most of a step (2048 small tensors, 2000 tensors x 4096) and on a network's
shapes. One contender per copy of the set (same seed, same gradients). A round times ``steps`` whole steps of each
contender, the order turned each round; a row gives each contender's median step time over the rounds, and the
ratios of the state checked to the state trusted and of the other checkout to this one, each the median of the
per-round ratios, with their range. After the last round the copies' weights must be equal bit for bit (the
checks decide nothing about the values; the script fails otherwise).

    python benchmarks/bench_host_checks.py [--quick] [--rounds N] [--backend cpp|torch] [--against DIR] [--report PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETS = ["small_tensors", "tensors_4096", "resnet18"]
QUICK_SETS = ["small_tensors"]
BASES = {"SGD": dict(lr=1e-3, momentum=0.9, weight_decay=5e-4), "AdamW": dict(lr=1e-3, weight_decay=0.01)}
TRUSTED, CHECKED, THIS, AGAINST = "trusted", "checked every step", "this checkout, own process", "other checkout"
#: the ratios a row gives: (numerator, denominator)
RATIOS = [(CHECKED, TRUSTED), (AGAINST, THIS)]


class Copy:
    """One copy of a set, stepped in this process by ``backend``; ``debug``: with the state checked at every step."""

    def __init__(self, key: str, base: str, quick: bool, backend: str, debug: bool = False):
        import torch

        import gearsam_fused

        import param_sets

        self.debug = debug
        self.built = param_sets.build(key, "cpu", quick)  # the same seed: the same weights and gradients for each
        cls = torch.optim.SGD if base == "SGD" else torch.optim.AdamW
        self.opt = gearsam_fused.SAM(
            self.built.model, cls, rho=0.05, backend=backend, base_step="fused", foreach=True, **BASES[base]
        )
        self._set_debug = getattr(gearsam_fused, "set_state_debug_mode", None)
        if debug and self._set_debug is None:
            raise SystemExit("this checkout has no set_state_debug_mode")

    def median_ms(self, steps: int) -> float:
        """The median of ``steps`` whole steps, in ms."""
        if self._set_debug is not None:
            self._set_debug(self.debug)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.opt.first_step()
            self.opt.second_step()
            times.append(time.perf_counter() - start)
        if self.opt.base_step_mode != "fused":
            raise AssertionError(f"the base step is {self.opt.base_step_mode!r}, not fused")
        return statistics.median(times) * 1e3

    def weights(self):
        import torch

        return torch.cat([p.detach().flatten() for p in self.built.model.parameters()])


class Worker:
    """A copy stepped by a process that imports ``gearsam_fused`` from ``checkout``, driven one line at a time."""

    def __init__(self, checkout: Path, key: str, base: str, quick: bool, backend: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(HERE)])}
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", key, base, "--backend", backend] + (
            ["--quick"] if quick else []
        )
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._ask("ready")

    def _ask(self, line: str) -> str:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the worker stopped (exit code {self.process.wait()})")
        return answer.strip()

    def median_ms(self, steps: int) -> float:
        return float(self._ask(f"time {steps}"))

    def weights(self, path: Path):
        import torch

        self._ask(f"weights {path}")
        self.process.stdin.close()  # the worker's loop ends with its input
        self.process.wait()
        return torch.load(path)


def serve(key: str, base: str, quick: bool, backend: str) -> None:
    """The worker's side of :class:`Worker`: answers ``ready``, ``time N`` and ``weights PATH`` on stdout."""
    import torch

    import gearsam_fused

    copy = Copy(key, base, quick, backend)
    print(gearsam_fused.__file__, file=sys.stderr)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "ready":
            answer = "ready"
        elif command == "time":
            answer = f"{copy.median_ms(int(args[0])):.6f}"
        elif command == "weights":
            torch.save(copy.weights(), args[0])
            answer = "saved"
        else:
            raise SystemExit(f"unknown command {line!r}")
        print(answer, flush=True)


def measure_set(key: str, base: str, rounds: int, warm_up: int, steps: int, quick: bool, against: Path | None,
                backend: str) -> dict:  # fmt: skip
    """One row: {set, tensors, parameters, base, backend, ms: {label: median}, ratio: {label: [median, low, high]}}."""
    import torch

    contenders = {TRUSTED: Copy(key, base, quick, backend), CHECKED: Copy(key, base, quick, backend, debug=True)}
    if against is not None:
        contenders[THIS] = Worker(HERE.parent, key, base, quick, backend)
        contenders[AGAINST] = Worker(against, key, base, quick, backend)
    labels = list(contenders)
    for contender in contenders.values():
        contender.median_ms(warm_up)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds):
        for label in labels[:: 1 if r % 2 == 0 else -1]:
            times[label].append(contenders[label].median_ms(steps))
    weights = [contenders[TRUSTED].weights(), contenders[CHECKED].weights()]
    if against is not None:
        with tempfile.TemporaryDirectory() as folder:
            weights += [contenders[label].weights(Path(folder) / f"{i}.pt") for i, label in enumerate((THIS, AGAINST))]
    if not all(torch.equal(weights[0], w) for w in weights[1:]):
        raise AssertionError(f"{key}, {base}: the contenders' weights differ after the same steps")
    params = list(contenders[TRUSTED].built.model.parameters())
    ratios = {}
    for numerator, denominator in RATIOS:
        if numerator in times:
            per_round = [t / d for t, d in zip(times[numerator], times[denominator])]
            ratios[f"{numerator} / {denominator}"] = [statistics.median(per_round), min(per_round), max(per_round)]
    return {
        "set": contenders[TRUSTED].built.name, "tensors": len(params), "parameters": sum(p.numel() for p in params),
        "base": base, "backend": contenders[TRUSTED].opt.backend_name, "ms": {label: statistics.median(values) for label, values in times.items()}, "ratio": ratios,
    }  # fmt: skip


def render(rows: list[dict], machine: dict, rounds: int, steps: int, against: str | None) -> str:
    labels = list(rows[0]["ms"])
    other = (
        f" `{AGAINST}`: the step of the checkout at {against}, and `{THIS}` this checkout's, each in a worker process."
        if against
        else ""
    )
    lines = [
        f"Measured on CPU {machine['cpu']} ({machine['cpu_count']} cores), {machine['date']}, commit "
        f"{machine['commit']}, torch {machine['torch']}. Eager whole step of the `{rows[0]['backend']}` backend, SAM "
        "with the base "
        f"step fused: the state `{TRUSTED}` once adopted (the default) and `{CHECKED}` (the state debug mode).{other} "
        f"Each contender's median of {steps} steps per round, {rounds} rounds alternated in one run; a ratio is the "
        "median of the per-round ratios, [lowest, highest] after it; the weights equal after them.",
        "",
        "| set | tensors | base | " + " | ".join(f"{label}, ms" for label in labels) + " | "
        + " | ".join(rows[0]["ratio"]) + " |",
        "|---|---:|---|" + "---:|" * (len(labels) + len(rows[0]["ratio"])),
    ]  # fmt: skip
    for row in rows:
        ms = " | ".join(f"{row['ms'][label]:.3f}" for label in labels)
        ratios = " | ".join(f"{m:.2f}x [{lo:.2f}, {hi:.2f}]" for m, lo, hi in row["ratio"].values())
        lines.append(
            f"| {row['set']} ({row['parameters'] / 1e6:.1f}M) | {row['tensors']} | {row['base']} | {ms} | {ratios} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small set, one round of three steps: a smoke run")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--backend", choices=("cpp", "torch"), default="cpp", help="the flat-buffer backend stepped")
    parser.add_argument("--against", type=Path, help="a checkout of this repository with its extension built in place")
    parser.add_argument("--report", type=Path, help="also write the table to this file")
    parser.add_argument("--rows", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--worker", nargs=2, metavar=("SET", "BASE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(HERE))
        serve(*args.worker, args.quick, args.backend)
        return
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from gearsam_fused.backends import available_backends
    from gearsam_fused.machine import describe_machine

    if args.backend not in available_backends():
        sys.exit(f"nothing to measure: the {args.backend} backend cannot run here")
    if args.against is not None and not (args.against / "gearsam_fused").is_dir():
        sys.exit(f"--against {args.against}: not a checkout of this repository (no gearsam_fused folder)")
    rounds, warm_up, steps = (1, 1, 3) if args.quick else (args.rounds, 5, 20)
    rows = []
    for key in QUICK_SETS if args.quick else SETS:
        for base in BASES:
            rows.append(measure_set(key, base, rounds, warm_up, steps, args.quick, args.against, args.backend))
            print(json.dumps(rows[-1]), flush=True)
    table = render(rows, describe_machine("cpu", checkout=HERE), rounds, steps, args.against)
    print(table)
    if args.report:
        args.report.write_text(table)
    if args.rows:
        args.rows.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
