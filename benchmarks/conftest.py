"""Settings shared by the benchmark suite: quick mode, the device, the memory floor measured in the same run, and the
results file every run appends its rows to, each row saying where, when and from which commit it was measured.

    python -m pytest benchmarks [--quick] [--results PATH]      (or: python benchmarks/run.py [--quick])
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from gearsam_fused.backends.cpp_backend import cpp_stream_threshold_bytes
from gearsam_fused.machine import describe_machine
from gearsam_fused.memory import flat_empty

from report import quartiles

if not torch.cuda.is_available():
    # lets the triton backend run on CPU tensors (slowly) if a benchmark asks for it explicitly
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE / "results" / "runs.jsonl"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: the run's id and machine, made at its first row; the rows this process appended
_RUN: dict = {}
_APPENDED: list[str] = []
#: a quick run (``--quick``), read by helpers that have no fixture to ask
_QUICK = False


def pytest_configure(config):
    global _QUICK
    _QUICK = config.getoption("--quick")


def pytest_addoption(parser):
    group = parser.getgroup("gearsam benchmarks")
    group.addoption(
        "--quick", action="store_true", help="small sets and few rounds: a smoke run (under two minutes on CPU)"
    )
    group.addoption(
        "--results", default=str(DEFAULT_RESULTS), help="JSONL file the run appends its rows to ('' for none)"
    )
    group.addoption(
        "--leave-out", default="", metavar="NAMES",
        help="comma-separated contenders the benchmarks that step their contenders in turn leave out (their rows say "
        "so), e.g. 'compiled foreach SAM' for a smoke run that compiles nothing",
    )  # fmt: skip
    group.addoption(
        "--compile-sets", default=None, metavar="KEYS",
        help="comma-separated set keys on which a full run steps the compiled contenders (default: every set); on the "
        "sets of about 2000 tensors their compiling takes minutes per row",
    )  # fmt: skip


@pytest.fixture(scope="session")
def quick(request) -> bool:
    return request.config.getoption("--quick")


@pytest.fixture(scope="session")
def compile_sets(request) -> list[str] | None:
    """The set keys of ``--compile-sets`` (None: every set)."""
    keys = request.config.getoption("--compile-sets")
    return None if keys is None else [key for key in keys.split(",") if key]


@pytest.fixture(scope="session")
def leave_out(request) -> dict[str, str]:
    """The contenders of ``--leave-out``, each with the note its group's rows carry."""
    names = [name.strip() for name in request.config.getoption("--leave-out").split(",") if name.strip()]
    return {name: "left out by --leave-out" for name in names}


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def warm_up(step, min_steps: int = 3, min_seconds: float = 0.5) -> None:
    """Run ``step`` until both limits are reached: first calls compile kernels, fill allocator caches and pick
    library algorithms, and the first benchmark of a process pays for all of that. A quick run is a smoke run whose
    times are not for reading: two steps (a compiled step's compile and its first run) do there."""
    if _QUICK:
        min_steps, min_seconds = min(min_steps, 2), 0.0
    start = time.perf_counter()
    done = 0
    while done < min_steps or time.perf_counter() - start < min_seconds:
        step()
        done += 1


def step_rounds(parameters: int, quick: bool) -> int:
    """Timed rounds of a SAM-step or whole-step row over ``parameters``: about 0.3 G parameters' worth, between 15 and
    30. A row's "% of floor" is the median of its rounds' ratios to the floor around them, and on a shared machine one
    round of five at a slow moment moved it by several percent (run ``d95845333668``: a quartile range of 83% to 88%
    over five rounds), so the largest sets get 15."""
    return 3 if quick else max(15, min(30, int(3e8 / parameters)))


def sam_step_of(opt):
    """One synchronised ``first_step`` + ``second_step`` of ``opt``."""

    def step():
        opt.first_step()
        opt.second_step()
        synchronize()

    return step


def step_in_turn(steps: dict, rounds: int, floor: MemoryFloor | None = None):
    """Contenders stepped in turn within each round: per round, the memory floor measured once (``floor``; outside any
    timing), then every step of ``steps`` (name -> a step that synchronises itself) once, each timed alone, the order
    turned by one place each round so that no contender always follows the same one; the garbage collector is off
    during the rounds (as pytest-benchmark's ``--benchmark-disable-gc`` for the other benchmarks). Returns the seconds
    of each step's rounds, in round order, and the floor's measurements around the rounds (one before each, one after
    the last; :meth:`MemoryFloor.around_rounds`), or None without ``floor``."""
    names = list(steps)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    measure_floor = floor.interleaved() if floor is not None else None
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            if measure_floor is not None:
                measure_floor()
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                steps[name]()
                seconds[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return seconds, (floor.around_rounds() if floor is not None else None)


#: the share of the memory available at a test's start that the contenders it steps in turn may take together
MEMORY_SHARE = 0.6


def available_memory_bytes() -> int:
    """Memory the contenders may still take: the GPU's free memory on CUDA, else the host's ``MemAvailable`` (Linux;
    elsewhere the total, through ``os.sysconf``)."""
    if DEVICE == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fit_in_memory(names: list[str], buffers_of, buffer_bytes: int, leave_first: tuple[str, ...],
                  available: int, fixed_buffers: int = 0) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """The contenders of ``names`` that fit together in :data:`MEMORY_SHARE` of ``available`` bytes, each holding
    ``buffers_of(name)`` buffers of ``buffer_bytes`` (and ``fixed_buffers`` shared by them), leaving out those of
    ``leave_first`` in that order until they fit; with a note for each one left out. Fails (``pytest.skip``) where
    even the rest would not fit."""
    kept, notes = list(names), {}

    def need() -> int:
        return (fixed_buffers + sum(buffers_of(name) for name in kept)) * buffer_bytes

    full = need()
    for name in leave_first:
        if need() <= MEMORY_SHARE * available:
            break
        if name in kept:
            kept.remove(name)
            notes[name] = (f"left out to fit in memory: the contenders together would hold {full / 2**30:.1f} GiB, "
                           f"more than {MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available")  # fmt: skip
    if need() > MEMORY_SHARE * available:
        pytest.skip(f"the contenders would hold {need() / 2**30:.1f} GiB even without {list(notes)}, more than "
                    f"{MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available")  # fmt: skip
    return kept, notes


class PairedRounds:
    """Another step timed just before each of a row's rounds, outside the row's time, for the row's cost over it at
    the same moment, which two rows' medians, minutes apart on a shared machine, do not give. ``setup`` is the
    benchmark's setup (inside :meth:`MemoryFloor.interleaved`); ``step`` synchronises itself and is warmed up here."""

    def __init__(self, step):
        self.step = step
        self.seconds: list[float] = []
        warm_up(step)

    def setup(self):
        start = time.perf_counter()
        self.step()
        self.seconds.append(time.perf_counter() - start)
        return (), {}

    def fields(self, round_s: list[float], name: str) -> dict:
        """``paired_<name>_ms``, the paired step's median, and ``over_paired_<name>`` with ``_q1``/``_q3``: the
        quartiles over the rounds of each round's time over the paired step's just before it."""
        q1, ratio, q3 = quartiles([s / p for s, p in zip(round_s, self.seconds, strict=True)])
        return {f"paired_{name}_ms": 1e3 * quartiles(self.seconds)[1], f"over_paired_{name}": ratio,
                f"over_paired_{name}_q1": q1, f"over_paired_{name}_q3": q3}  # fmt: skip


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


#: Parameters from which a row's counted bytes cannot fit in any cache: there, a rate above the floor is a bug in the
#: benchmark (a wrong count or a wrong floor), and the benchmark fails instead of recording it.
FLOOR_CHECKED_FROM = 50_000_000
#: bytes per float32 parameter of a SAM step's energy pass: it only reads g, so the traffic floor (MemoryFloor)
#: counts them at the read rate
ENERGY_BYTES = 4
#: bytes per float32 parameter of a SAM step's perturbation: w and g read, w + eps written (into the backup's buffer,
#: whose memory the parameters then take: csrc/cpu/exchange.h)
PERTURB_BYTES = 12


class FloorSample(NamedTuple):
    """One measurement of the memory floor (:meth:`MemoryFloor._sample`): every kind once, GB/s by the bytes each
    moves."""

    rates: dict[str, float]

    @property
    def fastest(self) -> float:
        """The fastest kind's rate in this measurement."""
        return max(self.rates.values())

    @property
    def read(self) -> float:
        """The read kind's rate: traffic that only reads."""
        return self.rates["read"]


class MemoryFloor:
    """The machine's streaming bandwidth, the floor every row's counted-bytes rate is compared with: STREAM-like
    kernels over buffers far beyond the caches, run through torch with every thread the benchmarks use, each counted
    by the bytes it really moves:

    =============  =====================  =====================================================================
    kind           operation              bytes per float32 element (CPU)
    =============  =====================  =====================================================================
    copy           ``b.copy_(a)``         12: a read, b written, and b read first (write-allocate: a store to a
                                          line not in the cache reads the line) -- 8 on CUDA, which does not
    triad          ``c = a + s * b``      16: a and b read, c written and read first -- 12 on CUDA
    update         ``a += s * b``         12: a and b read, a written; nothing hidden, as a is read anyway
    read           ``a.sum()``            4: a read (the energy pass's kind of traffic: only reads)
    streamed copy  ``restore_(b, a)``     8: a read, b written with non-temporal stores, which write whole lines
                                          without reading them (CPU, with the C++ extension built: the ``cpp``
                                          backend's copy, csrc/cpu/stream.h)
    streamed       ``perturb_(a, b, c)``  12: a and b read, c = a + s * b written with non-temporal stores,
    update                                then a and c trade their memory (CPU, with the extension built: the
                                          ``cpp`` backend's perturbation, csrc/cpu/exchange.h; 16 in runs before
                                          commit 177df32, where it wrote a in place and c = the old a)
    streamed       ``adam_step_(a, b, c,  28: the ``cpp`` backend's AdamW step from the backup ``c`` with the
    AdamW step     m, v)``                gradient ``b``, lr 1e-9 (CPU, with the extension built): a and c trade
                                          their memory, then a, b, m and v are read, a, m and v written in place
                                          (before commit 177df32: b, c, m and v read, m and v written, a
                                          written with non-temporal stores)
    =============  =====================  =====================================================================

    The last three are our own kernels' ways of moving memory: on this CPU updates in place combined with
    non-temporal stores move more bytes per second than any of STREAM's kernels written in torch (the AdamW step's
    four streams read and three written most of all), and a floor below what a kernel of ours reaches would be no
    floor.

    At the start of a run the kinds run interleaved, 10 rounds, and each kind's best is recorded. Then a row measures
    the floor again before each of its own timed rounds (:meth:`interleaved`), every kind once (:meth:`_sample`),
    because this machine's bandwidth moves with its neighbours' load: the row is compared with the floor of the same
    moments. The row's floor is one kind, the one fastest over its rounds (the highest median of its measurements),
    and each round is compared with that kind's measurements around it. Not the fastest kind of each moment: on this
    CPU three or four kinds run within about 1% of each other and one measurement of a kind varies by 3% to 7%, so
    the highest of seven single measurements is the high end of their noise, not what the memory moves (a row keeps
    both: ``floor_gbps``, its kind's median, and ``floor_highest_gbps``, the median of each measurement's highest).

    The floor's buffers are allocated as our flat buffers are (:mod:`gearsam_fused.memory`: on a Linux CPU, advised
    onto transparent huge pages), so that a row and its floor stream the same kind of memory.

    A copy counted at 8 bytes per element, as STREAM counts it, reads two thirds of the machine's bandwidth on a CPU:
    rows of kernels that write mostly what they also read then come out "above the floor".

    Traffic that only reads is slower on some machines than traffic that reads and writes: on this project's 2-core
    AMD EPYC the read kind moved 67% of the fastest kind's bytes per second at the start of run ``dd31bf25fe5c``. A
    step with a pass that only reads can then not reach the fastest kind's rate, however good its other passes are.
    So a row that says how many of its bytes are read-only passes (``read_only``, e.g. SAM's energy pass, 4 per
    float32 parameter) also gets its **traffic floor**: the rate the machine reaches on that mix, those bytes at the
    read kind's rate and the rest at the row's floor kind's, both measured around each of the row's rounds. The floor
    kind's rate stays the one a row is checked against (no row above it); the traffic floor is what a kernel that
    loses no time of its own reaches.
    """

    @staticmethod
    def _buffer(elements: int) -> torch.Tensor:
        # memory as our flat buffers have it (on a Linux CPU on transparent huge pages where the machine gives them):
        # a stream over 4 KiB pages is slower than the same one over 2 MiB pages, and would be no floor for our steps
        return flat_empty(elements, torch.float32, torch.device(DEVICE))

    def __init__(self, elements: int):
        self.a, self.b, self.c = (self._buffer(elements).uniform_() for _ in range(3))
        hidden = 4 if DEVICE == "cpu" else 0  # write-allocate: bytes read per element written without being read
        self.kinds = {
            "copy": (lambda: self.b.copy_(self.a), 8 + hidden),
            "triad": (lambda: torch.add(self.a, self.b, alpha=1e-3, out=self.c), 12 + hidden),
            "update": (lambda: self.a.add_(self.b, alpha=1e-9), 12),
            "read": (lambda: self.a.sum(), 4),
        }
        threshold = cpp_stream_threshold_bytes() if DEVICE == "cpu" else None
        if threshold is not None and 0 <= threshold < self.b.nbytes:
            # past the stream threshold our CPU kernels write what they do not read with stores that bypass the caches
            ops, tiles = torch.ops.gearsam_fused, torch.zeros(elements // 1024, dtype=torch.int32)
            scale = torch.tensor([1e-9], dtype=torch.float64)
            self.kinds["streamed copy"] = (lambda: ops.restore_(self.b, self.a, tile=1024), 8)
            self.kinds["streamed update"] = (
                lambda: ops.perturb_(self.a, self.b, self.c, scale, tiles, tile=1024, adaptive=False, eta=0.0),
                PERTURB_BYTES,
            )
            m, v = self._buffer(elements).zero_(), self._buffer(elements).uniform_()  # AdamW's moments: v >= 0
            adam = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, amsgrad=False,
                        maximize=False, lr=1e-9, step=3)  # fmt: skip
            self.kinds["streamed AdamW step"] = (
                lambda: ops.adam_step_(self.a, self.b, self.c, m, v, None, tile=1024, **adam),
                28,
            )
        rounds = [{kind: self._rate(kind) for kind in self.kinds} for _ in range(10)]
        self.start_gbps = {kind: max(r[kind] for r in rounds) for kind in self.kinds}
        self.kind = "the fastest over the row's rounds of " + ", ".join(self.kinds)
        self.samples: list[FloorSample] = []  # the floor measured between a row's rounds

    def _sample(self) -> FloorSample:
        """One measurement of the floor: every kind once."""
        return FloorSample({kind: self._rate(kind) for kind in self.kinds})

    def _rate(self, kind: str) -> float:
        run, bytes_per_element = self.kinds[kind]
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        return bytes_per_element * self.a.numel() / (time.perf_counter() - start) / 1e9

    def interleaved(self, setup=None):
        """A ``setup`` for ``benchmark.pedantic`` that measures the floor once, then calls ``setup`` (if any) and
        returns what it returns: the floor is measured before each of the row's rounds, outside its timing."""
        self.samples = []

        def measure_then_setup():
            self.samples.append(self._sample())
            return setup() if setup is not None else None

        return measure_then_setup

    def around_rounds(self) -> list[FloorSample]:
        """The measurements :meth:`interleaved` took before each round and one taken now, after the last: what
        :meth:`fields` compares rounds with, for several rows that shared those rounds."""
        samples, self.samples = self.samples, []
        return [*samples, self._sample()]

    def fields(self, counted: int, round_s: list[float], parameters: int, what: str, read_only: int = 0,
               samples: list[FloorSample] | None = None) -> dict:  # fmt: skip
        """A row's rate and floor fields, for ``counted`` bytes moved in each of its timed rounds ``round_s`` (in the
        order they ran, each just after a floor measurement of :meth:`interleaved`; one more is taken here, after the
        last round). ``gbps`` is the rate of the median round; ``floor_row_kind`` the kind fastest over the row's
        rounds (the highest median of its measurements) and ``floor_gbps`` that median; ``pct_floor`` the median over
        the rounds of each round's rate over that kind's rate around it (the mean of its measurements just before and
        just after it). Pairing each round with its own moment keeps the minutes-long swings of a shared machine's
        bandwidth out of the ratio. Where the row cannot fit in the caches (:data:`FLOOR_CHECKED_FROM`) and its rate is
        above even the best measurement of any kind, the row is a benchmark bug and ``what`` fails with the numbers, as
        where that median ratio is above 1.

        ``read_only``: how many of the ``counted`` bytes passes that only read move; where it is not 0,
        ``pct_traffic_floor`` is the median over the rounds of each round's rate over its traffic floor (the class's
        docstring), measured around it as above.

        ``samples``: the measurements around the rounds, one before each and one after the last (:meth:`around_rounds`),
        for rows whose rounds shared them (contenders stepped in turn within each round); by default those
        :meth:`interleaved` took and one taken now."""
        if not 0 <= read_only <= counted:
            raise ValueError(f"{what}: {read_only} read-only bytes of {counted} counted")
        if samples is None:
            samples, self.samples = self.samples, []
            if len(samples) != len(round_s):
                raise ValueError(
                    f"{what}: {len(round_s)} rounds timed but {len(samples)} floor measurements before them"
                )
            samples = [*samples, self._sample()]
        elif len(samples) != len(round_s) + 1:
            raise ValueError(f"{what}: {len(round_s)} rounds timed but {len(samples)} floor measurements around them")
        gbps = counted / statistics.median(round_s) / 1e9
        kind = max(samples[0].rates, key=lambda k: statistics.median(sample.rates[k] for sample in samples))
        rates = [sample.rates[kind] for sample in samples]
        around = _around(rates)
        ratios = [counted / s / 1e9 / floor for s, floor in zip(round_s, around)]
        q1, paired, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        best = max(sample.fastest for sample in samples)
        if parameters >= FLOOR_CHECKED_FROM:
            assert gbps <= best and paired <= 1, (
                f"{what}: {gbps:.1f} GB/s by counted bytes, {100 * paired:.1f}% of the floor around its rounds "
                f"({kind}), is above the memory floor measured between them (best {best:.1f} GB/s, {self.kind}) at "
                f"{parameters / 1e6:.0f}M parameters: the count or the floor is wrong"
            )
        fields = {"gbps": gbps, "floor_gbps": statistics.median(rates), "floor_best_gbps": best,
                  "floor_highest_gbps": statistics.median(sample.fastest for sample in samples),
                  "floor_kind": self.kind, "floor_row_kind": kind,
                  "pct_floor": 100 * paired, "pct_floor_q1": 100 * q1, "pct_floor_q3": 100 * q3,
                  "floor_paired": "each round with the floor around it", "floor_start_gbps": dict(self.start_gbps)}  # fmt: skip
        if read_only:
            fields.update(read_only_bytes=read_only, pct_traffic_floor=_pct_traffic_floor(
                counted, read_only, round_s, around, [sample.read for sample in samples]))  # fmt: skip
        return fields


def _around(measured: list[float]) -> list[float]:
    """Each round's rate around it: the mean of the measurements just before and just after it (one more measurement
    than rounds)."""
    return [(before + after) / 2 for before, after in zip(measured, measured[1:])]


def _pct_traffic_floor(counted: int, read_only: int, round_s: list[float], floor_around: list[float],
                       read: list[float]) -> float:  # fmt: skip
    """The median over the rounds of each round's rate over its traffic floor (:class:`MemoryFloor`): ``read_only``
    of the ``counted`` bytes at the read kind's rate around the round (the mean of ``read`` before and after it), the
    rest at the row's floor kind's (``floor_around``)."""
    traffic = [counted / (read_only / r + (counted - read_only) / f) for f, r in zip(floor_around, _around(read))]
    return 100 * statistics.median(counted / s / 1e9 / floor for s, floor in zip(round_s, traffic))


@pytest.fixture(scope="session")
def floor(quick) -> MemoryFloor:
    """The memory floor of this run (:class:`MemoryFloor`): its kind chosen at the start, then measured between
    each row's rounds."""
    return MemoryFloor((8 if quick else 64 if DEVICE == "cpu" else 256) * 2**20)


def machine() -> dict:
    """Where and with what a run was measured."""
    return describe_machine(DEVICE, checkout=Path(__file__).resolve().parent)


@pytest.fixture
def record(request, quick, benchmark):
    """``record(**fields)``: after a benchmark ran, append one row with its timing statistics and ``fields`` to the
    results file at once, so that a run stopped at a time limit keeps the rows it measured."""

    def add(**fields):
        stats = benchmark.stats.stats
        append_row(request.config.getoption("--results", default=""), {
            "benchmark": request.node.module.__name__.split(".")[-1], "test": request.node.name, "quick": quick,
            "device": DEVICE, "median_ms": stats.median * 1e3, "q1_ms": stats.q1 * 1e3, "q3_ms": stats.q3 * 1e3,
            "min_ms": stats.min * 1e3, "rounds": stats.rounds, **fields,
        })  # fmt: skip

    return add


@pytest.fixture
def record_rounds(request, quick):
    """``record_rounds(round_s, **fields)``: :func:`record` for a row the benchmark timed itself rather than through
    pytest-benchmark (several contenders stepped in turn within each round, so that their per-round ratios compare
    the same moments): the timing fields from ``round_s``, the seconds of each of the row's rounds, which the row
    also keeps (``round_ms``, in round order: the rows of one test share their rounds)."""

    def add(round_s: list[float], **fields):
        q1, median, q3 = quartiles(round_s)
        append_row(request.config.getoption("--results", default=""), {
            "benchmark": request.node.module.__name__.split(".")[-1], "test": request.node.name, "quick": quick,
            "device": DEVICE, "median_ms": median * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3,
            "min_ms": min(round_s) * 1e3, "rounds": len(round_s), "round_ms": [round(1e3 * s, 6) for s in round_s],
            **_load_average(), **fields,
        })  # fmt: skip

    return add


def _load_average() -> dict[str, float]:
    """The host's 1-minute load average when the row was written (``load_1min``; where the platform has one): on a
    2-core host whose neighbours run, a step of parallel regions waits for a descheduled thread, and its time says more
    about the neighbours than about the step."""
    try:
        return {"load_1min": os.getloadavg()[0]}
    except (AttributeError, OSError):
        return {}


def append_row(path: str, row: dict) -> None:
    """One row of this run, with the run's id and machine, appended to the JSONL file ``path`` ('' for none)."""
    if not path:
        return
    if not _RUN:
        _RUN.update(run=uuid.uuid4().hex[:12], **machine())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({**_RUN, **row}) + "\n")
    _APPENDED.append(row["test"])


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info.update(machine())


def pytest_sessionfinish(session, exitstatus):
    if _APPENDED:
        path = session.config.getoption("--results", default="")
        print(f"\n{len(_APPENDED)} rows appended to {path} (run {_RUN['run']})")
