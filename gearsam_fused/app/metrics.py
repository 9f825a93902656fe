"""The metrics file of a run directory: the training loop writes it, the plots read it.

``metrics.jsonl`` holds one JSON object per line, each with ``kind``, ``optimizer`` and ``seed``:

- ``epoch``: ``epoch`` (1-based), ``step`` (steps done), ``lr``, ``train_loss``, ``train_acc``, ``test_loss``,
  ``test_acc`` (accuracies in % of the images, as in every table and figure), ``train_sharpness`` (the epoch's mean
  realized sharpness L(w + eps) - L(w) over its training images, from the two losses of each step; None for SGD),
  ``seconds`` (training time so far), ``sam_seconds`` (of it, inside ``first_step``/``second_step`` but outside the
  base optimizer's step; 0 for SGD), ``epoch_seconds`` (the epoch's training time), ``cpu_seconds`` (the process's
  CPU time in training so far, all threads), ``sam_steps`` (steps so far that took the second pass: every step of a
  SAM/GEAR-SAM run under ``--second-pass always``, none of SGD's) and ``sam_fraction`` (the share of the epoch's
  steps that did); ``train_sharpness`` is then the mean over the images of those steps (None when there were none);
- ``blocks``: one per SAM/GEAR-SAM step, the :class:`~gearsam_fused.telemetry.BlockTelemetry` record: ``step``,
  ``rho``, ``blocks`` (names), per block ``energy``, ``score`` (allocation score), ``radius`` and ``share``, and the
  step's ``loss``, ``perturbed_loss`` and realized ``sharpness`` (None on a step that skipped the second pass),
  ``sam_step`` (whether it took the second pass) and ``sam_fraction`` (the share of the run's steps up to it that
  did, counted from its first step across resumptions);
- ``result``: once per finished run: ``epochs``, ``step``, ``test_loss``, ``test_acc``, ``seconds``, ``sam_seconds``,
  ``cpu_seconds``, ``sam_steps``.
"""

from __future__ import annotations

import json
from pathlib import Path

METRIC_KINDS = ("epoch", "blocks", "result")


class MetricsLog:
    """``metrics.jsonl``: appended line by line, so a run that dies keeps everything up to its last step."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def write(self, rows: list[dict]) -> None:
        with self.path.open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")

    def rows(self) -> list[dict]:
        """Every row written so far (none when the file does not exist yet)."""
        return read_metrics(self.path) if self.path.exists() else []

    def forget_after(self, optimizer: str, seed: int, step: int) -> None:
        """Drop a run's rows past ``step`` and its result: what a resumed run will write again."""
        keep = [
            r for r in self.rows()
            if not (r["optimizer"] == optimizer and r["seed"] == seed and (r["kind"] == "result" or r["step"] > step))
        ]  # fmt: skip
        self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def read_metrics(path: Path) -> list[dict]:
    """The rows of the metrics file ``path``, in the order written; a line that is not JSON is a ValueError naming
    it."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number} is not JSON: {exc}") from None
    return rows
