"""Per-step block statistics of a :class:`~gearsam_fused.SAM` / :class:`~gearsam_fused.GEARSAM` optimizer, kept on
its device and read in batches, so recording never makes the host wait for the device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .optim import SharpnessAware, check_sharpness_aware

#: Fields of every record :class:`BlockTelemetry` emits; each statistic is a list with one value per block.
RECORD_FIELDS = ("step", "rho", "blocks", "energy", "ema", "radius", "share", "non_finite")


class BlockTelemetry:
    """Records ``e_b``, the allocation score, ``rho_b`` and the budget share ``rho_b**2 / rho**2`` after every
    ``first_step`` and hands them to ``sink`` every ``every`` steps.

    :meth:`record` (call it right after ``first_step``) writes the step's energies, EMA and radii into row ``k`` of a
    ``[every, 3, B]`` float64 buffer on the optimizer's device with one ``torch.stack(..., out=)``; nothing is read
    back. When the buffer is full, or on :meth:`flush`, all pending rows reach the host in one copy, the only
    synchronisation, once per ``every`` steps. ``sink`` (default: append to :attr:`records`) then receives them as
    dicts with :data:`RECORD_FIELDS`:

    - ``step``: the optimizer step, numbered from 1 (from ``start + 1`` when a run resumes after ``start`` steps);
    - ``rho``: that step's global radius; ``blocks``: the block names;
    - per block: ``energy`` e_b, ``ema`` the allocation score (GEAR-SAM's EMA s_b; SAM's implicit ``sqrt(e_b)``),
      ``radius`` rho_b and ``share`` rho_b**2 / rho**2 (all 0 when rho is 0);
    - ``non_finite``: how many blocks had a non-finite energy that step (GEAR-SAM did not perturb them; SAM perturbed
      nothing that step).
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
        self._buffer = torch.empty(
            every, 3, len(optimizer.blocks), dtype=torch.float64, device=optimizer.step_statistics.ema.device
        )
        self._pending: list[tuple[int, float]] = []  # (step, rho) of each buffered row, known on the host

    def record(self) -> None:
        """Buffer the statistics of the ``first_step`` just taken (no host synchronisation)."""
        stats = self.optimizer.step_statistics
        row = self._buffer[len(self._pending)]
        torch.stack((stats.energy, stats.ema, stats.radius), out=row)
        self.step += 1
        self._pending.append((self.step, stats.rho))
        if len(self._pending) == self.every:
            self.flush()

    def flush(self) -> list[dict]:
        """Read every buffered row in one device-to-host copy and pass the records to ``sink``; returns them."""
        if not self._pending:
            return []
        rows = self._buffer[: len(self._pending)].to("cpu", copy=True)
        names = self.optimizer.block_names
        records = []
        for (step, rho), (energy, ema, radius) in zip(self._pending, rows):
            stats = self.optimizer.describe_blocks(energy, ema, radius, rho)
            records.append({"step": step, "rho": rho, "blocks": names, **{k: v.tolist() for k, v in stats.items()}})
        self._pending.clear()
        if self.sink is None:
            self.records.extend(records)
        else:
            self.sink(records)
        return records
