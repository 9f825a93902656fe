"""Per-step block statistics of a :class:`~gearsam_fused.SAM` / :class:`~gearsam_fused.GEARSAM` optimizer, kept on
its device and read in batches, so recording never makes the host wait for the device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .optim import SharpnessAware, check_sharpness_aware

#: Fields of every record :class:`BlockTelemetry` emits; each statistic is a list with one value per block.
RECORD_FIELDS = (
    "step", "rho", "blocks", "energy", "score", "radius", "share", "non_finite", "loss", "perturbed_loss", "sharpness",
    "sam_step", "sam_fraction",
)  # fmt: skip


class BlockTelemetry:
    """Records ``e_b``, the allocation score, ``rho_b`` and the budget share ``rho_b**2 / rho**2`` after every
    ``first_step`` and hands them to ``sink`` every ``every`` steps.

    :meth:`record` (call it after ``first_step``, before the next one) writes the step's energies, EMA and radii
    into row ``k`` of an ``[every, 3 * B + 2]`` float64 buffer on the optimizer's device with one
    ``torch.stack(..., out=)``, and the step's two losses, when given, into the row's last two entries; nothing is
    read back. When the buffer is full, or on :meth:`flush`, all pending rows reach the host in one copy, the only
    synchronisation, once per ``every`` steps. ``sink`` (default: append to :attr:`records`) then receives them as
    dicts with :data:`RECORD_FIELDS`:

    - ``step``: the optimizer step, numbered from 1 (from ``start + 1`` when a run resumes after ``start`` steps);
    - ``rho``: that step's global radius; ``blocks``: the block names;
    - per block: ``energy`` e_b, ``score`` the allocation score (GEAR-SAM's EMA s_b; SAM's implicit ``sqrt(e_b)``),
      ``radius`` rho_b and ``share`` rho_b**2 / rho**2 (all 0 when rho is 0);
    - ``non_finite``: how many blocks had a non-finite energy that step (GEAR-SAM did not perturb them; SAM perturbed
      nothing that step);
    - ``loss`` L(w), ``perturbed_loss`` L(w + eps) and ``sharpness``, the realized sharpness L(w + eps) - L(w): the
      two losses the step computed anyway, so it costs no extra pass (None when :meth:`record` was not given them);
    - ``sam_step``: whether the step perturbed (False on a step the optimizer's ``schedule`` skipped: its radii and
      shares are 0, and it has no ``perturbed_loss``); ``sam_fraction``: the fraction of SAM steps among the steps
      this telemetry recorded up to and including this one (also :attr:`sam_fraction`, known on the host at once).
    """

    def __init__(
        self,
        optimizer: SharpnessAware,
        every: int = 25,
        sink: Callable[[list[dict]], None] | None = None,
        start: int = 0,
    ):
        check_sharpness_aware(optimizer)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.optimizer = optimizer
        self.every = every
        self.sink = sink
        self.records: list[dict] = []
        self.step = start  # steps taken before the next record; records carry 1-based step numbers
        self._blocks = len(optimizer.blocks)
        device = optimizer.step_statistics.ema.device
        self._buffer = torch.empty(every, 3 * self._blocks + 2, dtype=torch.float64, device=device)
        # each row's (statistics, losses) views, made once so that recording a step is one stack
        self._rows = [(row[: 3 * self._blocks].view(3, self._blocks), row[3 * self._blocks :]) for row in self._buffer]
        # (step, rho, whether loss and perturbed_loss were given, whether it was a SAM step, the SAM-step fraction so
        # far) of each buffered row, known on the host
        self._pending: list[tuple[int, float, bool, bool, bool, float]] = []
        self.steps_recorded = 0  # steps recorded by this telemetry (not counting ``start``), and of them SAM steps
        self.sam_steps = 0

    @property
    def sam_fraction(self) -> float | None:
        """The fraction of the recorded steps that were SAM steps (1.0 without a schedule; None before any)."""
        return self.sam_steps / self.steps_recorded if self.steps_recorded else None

    def record(self, loss: torch.Tensor | None = None, perturbed_loss: torch.Tensor | None = None) -> None:
        """Buffer the statistics of the last ``first_step`` (no host synchronisation). ``loss`` and
        ``perturbed_loss``, the step's losses at ``w`` and at ``w + eps`` (scalar tensors), give its realized
        sharpness: call this after the second pass to pass them. On a step the schedule skipped there is no
        ``w + eps``: pass ``loss`` alone, or nothing."""
        stats = self.optimizer.step_statistics
        sam = bool(stats.sam_step)
        if sam and (loss is None) != (perturbed_loss is None):
            raise ValueError("pass both loss and perturbed_loss (the losses at w and at w + eps), or neither")
        if not sam and perturbed_loss is not None:
            raise ValueError(
                "the last step was one the schedule skipped: it did not perturb, so it has no perturbed_loss; pass "
                "loss alone"
            )
        statistics, losses = self._rows[len(self._pending)]
        torch.stack((stats.energy, stats.ema, stats.radius), out=statistics)
        if perturbed_loss is not None:
            losses.copy_(torch.stack((loss.detach().reshape(()), perturbed_loss.detach().reshape(()))))
        elif loss is not None:
            losses[0].copy_(loss.detach().reshape(()))
        self.step += 1
        self.steps_recorded += 1
        self.sam_steps += sam
        # a capturable optimizer's rho is a device tensor it writes again next step: kept as a copy, read at flush
        rho = stats.rho.clone() if isinstance(stats.rho, torch.Tensor) else stats.rho
        self._pending.append((self.step, rho, loss is not None, perturbed_loss is not None, sam, self.sam_fraction))
        if len(self._pending) == self.every:
            self.flush()

    def flush(self) -> list[dict]:
        """Read every buffered row in one device-to-host copy and pass the records to ``sink``; returns them."""
        if not self._pending:
            return []
        rows = self._buffer[: len(self._pending)].to("cpu", copy=True)
        names = self.optimizer.block_names
        records = []
        for (step, rho, with_loss, with_perturbed, sam, fraction), row in zip(self._pending, rows):
            rho = float(rho)
            energy, ema, radius = row[: 3 * self._blocks].view(3, self._blocks)
            stats = self.optimizer.describe_blocks(energy, ema, radius, rho)
            loss, perturbed = row[3 * self._blocks :].tolist()
            loss, perturbed = (loss if with_loss else None), (perturbed if with_perturbed else None)
            sharpness = perturbed - loss if with_perturbed else None
            records.append({
                "step": step, "rho": rho, "blocks": names, **{k: v.tolist() for k, v in stats.items()},
                "loss": loss, "perturbed_loss": perturbed, "sharpness": sharpness, "sam_step": sam,
                "sam_fraction": fraction,
            })  # fmt: skip
        self._pending.clear()
        if self.sink is None:
            self.records.extend(records)
        else:
            self.sink(records)
        return records
