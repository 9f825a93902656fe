"""Time on the clock of the device doing the work: CUDA events on a GPU, recorded without waiting for it and read
later, ``time.perf_counter()`` elsewhere. The package's one timer (the command line's ``Stopwatch``, the Trainer
integration's step clock)."""

from __future__ import annotations

import time

import torch

#: A moment on a device's clock, from :func:`mark`.
Mark = float | torch.cuda.Event


def mark(device: torch.device) -> Mark:
    """The present moment on ``device``'s clock; on CUDA, when the work queued so far is done (nothing waits)."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds(start: Mark, end: Mark) -> float:
    """Seconds from ``start`` to ``end``, two marks of the same device; on CUDA this waits for the device to reach
    ``end``."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3
