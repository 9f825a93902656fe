"""Settings shared by the benchmark suite: quick mode, the device, a copy bandwidth measured in the same run, and the
results file every run appends its rows to, each row saying where, when and from which commit it was measured.

    python -m pytest benchmarks [--quick] [--results PATH]      (or: python benchmarks/run.py [--quick])
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
import torch

from gearsam_fused.app.machine import describe_machine

if not torch.cuda.is_available():
    # lets the triton backend run on CPU tensors (slowly) if a benchmark asks for it explicitly
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE / "results" / "runs.jsonl"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ROWS: list[dict] = []


def pytest_addoption(parser):
    group = parser.getgroup("gearsam benchmarks")
    group.addoption(
        "--quick", action="store_true", help="small sets and few rounds: a smoke run (under two minutes on CPU)"
    )
    group.addoption(
        "--results", default=str(DEFAULT_RESULTS), help="JSONL file the run appends its rows to ('' for none)"
    )


@pytest.fixture(scope="session")
def quick(request) -> bool:
    return request.config.getoption("--quick")


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def warm_up(step, min_steps: int = 3, min_seconds: float = 0.5) -> None:
    """Run ``step`` until both limits are reached: first calls compile kernels, fill allocator caches and pick
    library algorithms, and the first benchmark of a process pays for all of that."""
    start = time.perf_counter()
    done = 0
    while done < min_steps or time.perf_counter() - start < min_seconds:
        step()
        done += 1


def cuda_event_median_ms(step, n: int = 50) -> float:
    """Milliseconds per call of ``step``, by CUDA events around ``n`` back-to-back calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def cuda_launches(step) -> int:
    """CUDA kernels one call of ``step`` launches (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


@pytest.fixture(scope="session")
def copy_bandwidth(quick) -> float:
    """GB/s of one large device-to-device copy (bytes read plus bytes written), median of 10: the yardstick for
    the bandwidth the fused steps reach."""
    n = (8 if quick else 64 if DEVICE == "cpu" else 256) * 2**20  # float32 elements
    src = torch.randn(n, device=DEVICE)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * src.nbytes / sorted(times)[len(times) // 2] / 1e9


def machine() -> dict:
    """Where and with what a run was measured."""
    return describe_machine(DEVICE)


@pytest.fixture
def record(request, quick, benchmark):
    """``record(**fields)``: after a benchmark ran, store one row with its timing statistics and ``fields``."""

    def add(**fields):
        stats = benchmark.stats.stats
        _ROWS.append({
            "benchmark": request.node.module.__name__.split(".")[-1], "test": request.node.name, "quick": quick,
            "device": DEVICE, "median_ms": stats.median * 1e3, "q1_ms": stats.q1 * 1e3, "q3_ms": stats.q3 * 1e3,
            "min_ms": stats.min * 1e3, "rounds": stats.rounds, **fields,
        })  # fmt: skip

    return add


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info.update(machine())


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--results", default="")
    if not _ROWS or not path:
        return
    run = {"run": uuid.uuid4().hex[:12], **machine()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for row in _ROWS:
            f.write(json.dumps({**run, **row}) + "\n")
    print(f"\n{len(_ROWS)} rows appended to {path} (run {run['run']})")
