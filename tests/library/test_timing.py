"""The package's one timer: marks on the device's clock and the seconds between them."""

import time

import pytest
import torch

from gearsam_fused import timing


def test_seconds_between_cpu_marks_is_the_host_clock():
    start = timing.mark(torch.device("cpu"))
    time.sleep(0.01)
    end = timing.mark(torch.device("cpu"))
    assert isinstance(start, float) and timing.seconds(start, end) >= 0.01


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_marks_are_events_read_when_asked():
    device = torch.device("cuda")
    start = timing.mark(device)
    torch.cuda._sleep(1_000_000)  # about a millisecond of GPU time, queued
    end = timing.mark(device)
    assert isinstance(start, torch.cuda.Event) and timing.seconds(start, end) > 0.0
