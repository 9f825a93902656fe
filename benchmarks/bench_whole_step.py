"""The whole optimizer step: ``first_step`` + ``second_step``, including the base optimizer's update.

Where :mod:`bench_sam_step` times the SAM machinery alone (its base optimizer does nothing), this times what a
training loop pays for the optimizer: SAM's energy, perturbation and restore plus a real base step, torch's SGD with
momentum and weight decay or AdamW. gearsam_fused fuses the base step with the restore when it can (``base_step``);
the rows show what that fusion buys against the same backend stepping the base optimizer per tensor, against the
per-tensor implementations, and against the base optimizer's step alone.

Contenders, each around the same base optimizer, each at its best: a per-tensor contender that steps torch's
optimizer itself takes it with ``fused=True`` (torch's fastest step on CPU and CUDA), except where torch refuses it
(pytorch_optimizer's ``foreach=True`` path hands ``foreach=True`` on to it) or the step is compiled (``foreach=True``,
which inductor turns into its own loops):

=============================  ====================================================================================
``per-tensor loop``            :class:`contenders.PerTensorLoopSAM`, then the base optimizer's ``step()`` (fused)
``pytorch_optimizer``          ``pytorch_optimizer.SAM(..., foreach=True)`` (skipped with a note when not installed)
``pytorch_optimizer, per tensor``  the same with ``foreach=False`` (its default on CPU), its base optimizer fused: the
                               report compares with the faster of its two paths and names it
``compiled foreach SAM``       :class:`contenders.CompiledForeachSAM`: SAM in ``torch._foreach_*`` operations with
                               float32 norms, its perturbation one ``torch.compile``-d function and its restore with
                               the base optimizer's ``step()`` another
``compiled foreach SAM, reduce-overhead``  (CUDA only, sets :data:`GRAPH_SET_KEYS`) the same under
                               ``torch.compile(mode="reduce-overhead")``: inductor captures both in CUDA graphs
``torch``, ``cpp``, ``triton``  gearsam_fused's SAM on that backend with ``base_step="fused"`` (``triton``: CUDA only)
``BACKEND, base per tensor``   the same with ``base_step="per-tensor"``: a flat restore, then the base ``step()``
                               (fused)
``BACKEND, compiled``          the fused row's optimizer (``cpp``; ``triton`` on CUDA) with ``first_step`` and
                               ``second_step`` each under ``torch.compile(fullgraph=True)``, compiled in the warm-up
``BACKEND, CUDA graph``        (CUDA only) the fused row's optimizer built with ``capturable=True``, three steps on a
                               side stream, one step captured in a ``torch.cuda.CUDAGraph``; the timed step is
                               ``graph.replay()`` (sets :data:`GRAPH_SET_KEYS`)
``bare base step``             the base optimizer's ``step()`` alone, no SAM, ``foreach=True``
``bare base step (fused)``     the same with ``fused=True``: "/ torch's base step" is over the faster of the two in
                               the same rounds, and the report names it
=============================  ====================================================================================

**Stepped in turn.** One test per set and base optimizer builds every contender, each on a copy of the set of its own
(the same seed: the same weights and gradients; from :data:`SHARED_FROM` parameters, where no cache holds a set, the
contenders that update its tensors in place, the peer's paths, torch's steps and the compiled foreach SAM, share one
copy, so that a full run's largest sets fit in a CPU host's memory), warms each up, then times them in rounds
(``conftest.step_in_turn``): a round measures the memory floor once, then steps every contender once, each step timed
alone, the order turned by one place each round. A row keeps its time in each round (``round_ms``), and its ratios to
the references of the same rounds are medians of per-round ratios with their quartiles and range
(``rows.interleaved_fields``): ``vs`` (the reference's time over this one's: the per-tensor loop, pytorch_optimizer's
path faster in these rounds, the compiled foreach SAM; ``vs_path`` names the path) and ``over`` (this one's time
over torch's base step, its path faster in these rounds; ``over_path``). The ratio of two medians timed minutes apart
on a shared machine, which the rows of runs before this layout give, moved with the machine's load between them.

Counted bytes per step for d float32 parameters, the floor of a fused step: energy reads g (4d); perturb reads w and
g and writes w + eps (12d: into the backup's buffer, which then trades its memory with the parameters', as the
``cpp`` CPU kernels do past the stream threshold, csrc/cpu/exchange.h; a perturbation in place that copies w to the
backup moves 16d); restore-and-update reads w, g and the optimizer's state and writes w and the state: SGD with
momentum 20d (w, g, momentum buffer in; w, buffer out), AdamW 28d (w, g, two moments in; w, two moments out). So 36d
for SGD and 44d for AdamW, the same yardstick for every SAM contender (runs before commit 177df32 counted the 16d
perturbation: 40d and 48d; each row records its count); the bare base step is counted at its own 20d and 28d. GB/s is that count over the median time, ``pct_floor`` compares it
with the memory floor measured in the same run (``conftest.MemoryFloor``), and ``pct_traffic_floor`` (SAM rows) with
the floor of its traffic, the energy pass's 4d, which only reads, at the read rate measured beside it. On CUDA a row
also records kernel launches per step (torch profiler) and the median by CUDA events.

The compiled rows record ``compile_s``, the seconds of their calls that compiled (:class:`contenders.CompileTimer`:
the first calls, and the recompiles of the first steps -- SGD's first momentum step, Adam's step counts 0, 1 and then
a symbolic one), before any timing: the warm-up goes on until a whole step compiles nothing, and a row that compiles
while it is timed fails. Our compiled rows are the same kernels as the eager row (registered operators that the
compiler calls as they are) and the same counted bytes. The CUDA-graph rows record ``capture_s``, the wall time of
the three side-stream steps and the capture. Both must record ``base_step_mode == "fused"``, as the eager rows.

The compiled foreach SAM's row also records how far its step is from ours: before timing, one whole step of it and
one of our SAM (``cpp`` backend where usable, else ``torch``) from identical weights and gradients, compared after
``first_step`` (``w + eps``) and after ``second_step`` (the new ``w``), ``a`` the contender's weights and ``b`` ours,
the larger of the two points:

``max_rel_diff``             ``max_i |a_i - b_i| / max_i |b_i|`` over all the set's parameters as one vector: it must
                             be within the test suite's float32 tolerance per step, :data:`FP32_STEP_RTOL`
``max_rel_diff_per_tensor``  the same per tensor, the largest over the tensors (recorded, not checked): it shows that
                             torch's AdamW under ``torch.compile`` computes the bias corrections from a float32 step
                             (``1 - 0.999 ** step`` rounded in float32, where eager torch uses a Python float), so
                             its first update is 6.8e-6 smaller; on a tensor that starts at zero (a bias) that is the
                             tensor's whole value

The gradient is the same at both points (no second pass), so the point after the restore checks the base update and
the perturbation is checked on its own.

The SAM family (``test_family_whole_step``, one test per variant and base optimizer): each variant of
:data:`contenders.FAMILY` (GSAM, WSAM, F-SAM, GEAR-SAM with GSAM's descent, and SAM and GEAR-SAM as their yardsticks),
ours on each backend with ``base_step="fused"`` and pytorch_optimizer's on both its paths where it has the variant, on
:data:`contenders.FAMILY_SET_KEY` with both base optimizers, counted at 36d / 44d plus the bytes the variant's parts
move in a fused whole step (``Variant.extra_bytes - Variant.folded_bytes``). As in :mod:`bench_sam_step`, a variant's
contenders are stepped in turn within each round with the yardsticks their ratios need (:func:`family_rounds`): each
contender's plain variant and, for a GEAR-SAM variant, the peer's variant under SAM's radius; ``vs`` and ``over``
(``own SAM``) are medians of per-round ratios. Quick mode runs it on one of our backends and the peer's ``foreach``
path, with SGD, only.

The sets are :data:`param_sets.WHOLE_STEP_SET_KEYS`; quick mode runs :data:`QUICK_SET_KEYS` only, with a shorter
warm-up: a smoke run, not a measurement (the compiled contenders there on :data:`COMPILED_QUICK_SET_KEYS` only). A
full run steps the compiled contenders on the sets of ``--compile-sets`` (default: every set); the rows of a set
without them say so (``left_out``).
"""

from __future__ import annotations

import gc
import time
from typing import NamedTuple

import pytest
import torch
import torch._dynamo

from gearsam_fused import SAM, SharpnessAware

import contenders
import param_sets
from conftest import (
    DEVICE,
    ENERGY_BYTES,
    PERTURB_BYTES,
    available_memory_bytes,
    cuda_event_median_ms,
    cuda_launches,
    fit_in_memory,
    sam_step_of,
    step_in_turn,
    step_rounds,
    synchronize,
    warm_up,
)
from rows import family_fields, interleaved_fields

RHO = 0.05
#: base optimizer name -> (class, hyperparameters) and the bytes counted per parameter for a step with it
BASES = {
    "SGD": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
}
BYTES_PER_PARAM = {"SGD": ENERGY_BYTES + PERTURB_BYTES + 20, "AdamW": ENERGY_BYTES + PERTURB_BYTES + 28}
#: the base optimizer's step alone: w, g and the state in, w and the state out
BARE_BYTES_PER_PARAM = {"SGD": 20, "AdamW": 28}
#: the sets of a quick run: a network's shapes and the two sets of many small tensors, where the fusion matters most
QUICK_SET_KEYS = ["resnet18", "small_tensors", "tensors_4096"]

#: the only set of a quick run with the compiled contenders (ours and the foreach SAM). A full run compiles them on
#: every set, and on the sets of about 2000 tensors that dominates its time: dynamo traces, and inductor schedules and
#: generates code for, every tensor of the lists, in a time linear in the tensors (benchmarks/README.md says how
#: long on 2 CPU cores).
COMPILED_QUICK_SET_KEYS = ["resnet18"]
#: the test suite's relative error allowed per float32 step (tests/conftest.py)
FP32_STEP_RTOL = 1e-6

LOOP = "per-tensor loop"
COMPILED, COMPILED_CAPTURED = contenders.COMPILED, contenders.COMPILED_CAPTURED
BARE, BARE_FUSED = "bare base step", "bare base step (fused)"
#: what every row is compared with in the same rounds: label -> the paths it stands for, the faster one of the rounds
#: taken (``vs``: the reference's time over the row's) ...
REFERENCES = {LOOP: (LOOP,), contenders.PEER: tuple(contenders.PEER_PATHS), COMPILED: (COMPILED,)}
#: ... and torch's own step, the faster of its two paths (``over``: the row's time over it)
TORCH_STEP = "torch's base step"
OVER = {TORCH_STEP: (BARE, BARE_FUSED)}
#: the base optimizer's flags where a contender steps it per tensor: torch's fastest step, on CPU and CUDA
FUSED_BASE = {"fused": True}
#: parameters from which the contenders that update the set's tensors in place share one copy of it: such a set fits
#: in no cache (so no contender finds another's tensors there), and a copy for each would not fit in a CPU host's
#: memory (GPT-2's shapes at width 512 with AdamW: about 44 buffers of 408 MB with sharing, 53 without)
SHARED_FROM = 50_000_000
#: the contenders that may share a copy: they update the parameters in place and keep them where they are (the
#: per-tensor loop re-points ``p.data``, ours re-home the tensors into their flat buffers, and the captured compiled
#: contender's CUDA graphs read addresses of their own)
IN_PLACE = (*contenders.PEER_PATHS, COMPILED, BARE, BARE_FUSED)
#: buffers of the set's size the base optimizer's state holds
STATE_BUFFERS = {"SGD": 1, "AdamW": 2}
#: buffers of the set's size a step allocates for the time it runs (pytorch_optimizer's foreach perturbation: a list
#: of temporaries beside its clones), one contender stepping at a time
STEP_TEMPORARIES = 2
#: the contenders left out first, in this order, where a set's contenders would not fit in memory together
#: (``conftest.fit_in_memory``): the per-tensor base rows and the compiled step of ours, then the torch backend
LEAVE_FIRST = (
    "torch, base per tensor", "cpp, base per tensor", "triton, base per tensor", "cpp, compiled",
    "triton, compiled", "torch",
)  # fmt: skip
PER_TENSOR = ", base per tensor"  # suffix of our contenders that step the base optimizer per tensor
#: suffixes of our fused contenders under torch.compile(fullgraph=True) and captured in a CUDA graph (CUDA only)
COMPILED_STEP, CUDA_GRAPH = ", compiled", ", CUDA graph"
OUR_BACKENDS = ("torch", "cpp", "triton")
#: our backends whose kernels are registered operators that a compiled step calls as they are, the ones with
#: capturable kernels (``capturable=True``) too; the torch backend's step under torch.compile is not benchmarked
COMPILED_BACKENDS = ("cpp", "triton")
#: the sets of the CUDA-graph rows: a network's shapes and many small tensors, where launches cost most
GRAPH_SET_KEYS = ["resnet18", "small_tensors"]
#: eager steps on a side stream before the capture, as torch's CUDA graph recipe does (kernels compiled, the
#: optimizer's state and its step counts made, the allocator warm)
GRAPH_WARM_UP_STEPS = 3
#: steps the warm-up of a compiled row may add until a whole step compiles nothing
MAX_SETTLING_STEPS = 10
NOT_INSTALLED = contenders.not_installed()  # peers shown as skipped, with the note, instead of left out


def whole_step_contenders(device: str) -> list[str]:
    """The contenders that can run on ``device`` here, in the order the report lists them."""
    usable = contenders.available(device)  # leaves out triton on CPU and backends that are not built
    names = [name for name in (LOOP, *contenders.PEER_PATHS) if name in usable] + [COMPILED]
    names += [COMPILED_CAPTURED] if device == "cuda" else []
    for backend in OUR_BACKENDS:
        if backend in usable:
            names += [backend, backend + PER_TENSOR]
            if backend in COMPILED_BACKENDS:  # triton: only where usable, i.e. on CUDA
                names.append(backend + COMPILED_STEP)
            if backend in COMPILED_BACKENDS and device == "cuda":
                names.append(backend + CUDA_GRAPH)
    return [*names, BARE, BARE_FUSED]


def compiles(name: str) -> bool:
    """Whether contender ``name`` is compiled (its warm-up compiles it)."""
    return name in (COMPILED, COMPILED_CAPTURED) or name.endswith(COMPILED_STEP)


def left_out(name: str, set_key: str, quick: bool, compile_sets: list[str] | None) -> str | None:
    """Why contender ``name`` does not run on ``set_key`` (None: it does)."""
    if compiles(name) and quick and set_key not in COMPILED_QUICK_SET_KEYS:
        return f"quick mode compiles for {COMPILED_QUICK_SET_KEYS} only"
    if compiles(name) and not quick and compile_sets is not None and set_key not in compile_sets:
        return f"this run compiled for {compile_sets} only (--compile-sets)"
    if (name.endswith(CUDA_GRAPH) or name == COMPILED_CAPTURED) and set_key not in GRAPH_SET_KEYS:
        return f"captured for {GRAPH_SET_KEYS} only"
    return None


def capture(opt) -> tuple[torch.cuda.CUDAGraph, float]:
    """``opt`` (built with ``capturable=True``) warmed up by :data:`GRAPH_WARM_UP_STEPS` whole steps on a side stream,
    then one whole step captured: the graph, and the seconds all of that took. The gradients stay where they are,
    views of the flat buffers (nothing sets them to None), so the graph reads the buffers the benchmark filled."""
    start = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARM_UP_STEPS):
            opt.first_step()
            opt.second_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.first_step()
        opt.second_step()
    torch.cuda.synchronize()
    return graph, time.perf_counter() - start


def make(name: str, base: str, model: torch.nn.Module):
    """(optimizer, step): contender ``name`` around the base optimizer ``base`` over ``model``'s parameters, and one
    whole step of it."""
    cls, kwargs = BASES[base]
    if name in (BARE, BARE_FUSED):
        flag = FUSED_BASE if name == BARE_FUSED else {"foreach": True}
        opt = cls(model.parameters(), **kwargs, **flag)
        return opt, opt.step
    if name == LOOP:
        opt = contenders.PerTensorLoopSAM(model.parameters(), cls, rho=RHO, **FUSED_BASE, **kwargs)
    elif name in contenders.PEER_PATHS:
        import pytorch_optimizer

        foreach = contenders.PEER_PATHS[name]  # handed on to the base optimizer: torch refuses it with fused=True
        opt = pytorch_optimizer.SAM(model.parameters(), cls, rho=RHO, foreach=foreach,
                                    **({} if foreach else FUSED_BASE), **kwargs)  # fmt: skip
    elif name in (COMPILED, COMPILED_CAPTURED):
        # foreach=True inside; dynamo was reset once for all the contenders of the rounds (make's caller)
        mode = "reduce-overhead" if name == COMPILED_CAPTURED else None
        opt = contenders.CompiledForeachSAM(model.parameters(), cls, rho=RHO, mode=mode, reset=False, **kwargs)
    elif name.endswith(COMPILED_STEP):
        opt = SAM(model, cls, rho=RHO, backend=name.removesuffix(COMPILED_STEP), base_step="fused", foreach=True,
                  **kwargs)  # fmt: skip

        # functions of this row's own, each compiled whole (fullgraph=True, the optimizer's calls inlined) and entered
        # with gradients off (inference graphs, as the methods' own torch.no_grad gives): compiling the bound methods
        # would compile the frame of torch.no_grad's wrapper, one code object for every function it decorates, whose
        # dynamo cache entries another compiled contender of the same process may already hold
        def first_step():
            opt.first_step()

        def second_step():
            opt.second_step()

        first = torch.compile(first_step, fullgraph=True)
        second = torch.compile(second_step, fullgraph=True)
        timer = contenders.CompileTimer()

        def compiled_step():
            with torch.no_grad():
                timer(first)
                timer(second)

        compiled_step.timer = timer
        return opt, compiled_step
    elif name.endswith(CUDA_GRAPH):
        # lr, rho and the step counts on the device; "fused" is implied (and checked below, as for every row)
        opt = SAM(model, cls, rho=RHO, backend=name.removesuffix(CUDA_GRAPH), base_step="fused", foreach=True,
                  capturable=True, **kwargs)  # fmt: skip
        graph, seconds = capture(opt)
        replay = graph.replay
        step = lambda: replay()  # noqa: E731 (a function of its own, to carry the attributes)
        step.graph, step.capture_s = graph, seconds  # the graph lives as long as the step
        return opt, step
    else:
        backend, per_tensor, _ = name.partition(PER_TENSOR)
        mode = "per-tensor" if per_tensor else "fused"  # "fused" fails at construction when it cannot be honoured
        flag = FUSED_BASE if per_tensor else {"foreach": True}  # the fused path reads the hyperparameters only
        opt = SAM(model, cls, rho=RHO, backend=backend, base_step=mode, **flag, **kwargs)

    def step():
        opt.first_step()
        opt.second_step()

    return opt, step


def rel_diffs(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """``max_i |a_i - b_i| / max_i |b_i|`` over all the tensors as one vector, and the largest of it per tensor (its
    denominator at least 1e-30)."""
    errors = [(x - y).abs().max().item() for x, y in zip(a, b)]
    peaks = [y.abs().max().item() for y in b]
    return max(errors) / max(max(peaks), 1e-30), max(e / max(p, 1e-30) for e, p in zip(errors, peaks))


def compiled_parity(opt, params: list[torch.Tensor], set_key: str, base: str, quick: bool) -> dict[str, float]:
    """One whole step of the compiled contender ``opt`` (over ``params``, the set ``set_key`` freshly built) and one
    of our SAM on a second copy of the set: :func:`rel_diffs` after ``first_step`` and after ``second_step``, the
    larger of the two, as ``max_rel_diff`` and ``max_rel_diff_per_tensor``."""
    twin = param_sets.build(set_key, DEVICE, quick)
    assert all(torch.equal(p, q) and torch.equal(p.grad, q.grad) for p, q in zip(params, twin.params))
    backend = "cpp" if "cpp" in contenders.available(DEVICE) else "torch"
    cls, kwargs = BASES[base]
    ours = SAM(twin.model, cls, rho=RHO, backend=backend, foreach=True, **kwargs)
    diffs = []
    for first, second in ((opt.first_step, ours.first_step), (opt.second_step, ours.second_step)):
        first(), second()
        synchronize()
        diffs.append(rel_diffs(params, twin.params))
    return {"max_rel_diff": max(d[0] for d in diffs), "max_rel_diff_per_tensor": max(d[1] for d in diffs)}


def pytest_generate_tests(metafunc):
    # the sets depend on --quick, known once the options are parsed
    if "set_key" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        metafunc.parametrize("set_key", QUICK_SET_KEYS if quick else param_sets.WHOLE_STEP_SET_KEYS)


def held_buffers(name: str, base: str, shared: bool) -> int:
    """Buffers of the set's size contender ``name`` holds at most: its copy of the set (parameters and gradients; none
    where it shares one), the base optimizer's state and, but for torch's step alone, its backup (the per-tensor loop
    and the peer clone one at each step)."""
    own = STATE_BUFFERS[base] + (0 if name in (BARE, BARE_FUSED) else 1)
    return own + (0 if shared and name in IN_PLACE else 2)


def settle(name: str, step, timer: contenders.CompileTimer) -> None:
    """Warm up compiled row ``name``'s ``step`` until a whole step compiles nothing (the first steps recompile: step
    counts); it must have compiled (a compiled function that dynamo left eager, as when another function's cache
    entries answered its frame, would be timed as an eager step under the compiled row's name)."""
    warm_up(step)
    for _ in range(MAX_SETTLING_STEPS):
        calls = timer.compiling_calls
        step()
        if timer.compiling_calls == calls:
            break
    else:
        pytest.fail(f"{name} still compiled after {MAX_SETTLING_STEPS} more warm-up steps")
    if timer.compiling_calls == 0:
        pytest.fail(f"{name} never compiled: dynamo ran it eagerly")


def base_flags(name: str) -> str:
    """How contender ``name`` steps the base optimizer, for its row."""
    if name.split(", ")[0] in OUR_BACKENDS and not name.endswith(PER_TENSOR):
        return "fused into the restore"
    if compiles(name):
        return "foreach=True, compiled"
    if name in (BARE, contenders.PEER):
        return "foreach=True"
    return "fused=True"


@pytest.mark.parametrize("base", list(BASES))
def test_whole_step(record_rounds, quick, floor, compile_sets, leave_out, base, set_key):
    names, notes = [], {}
    for name in whole_step_contenders(DEVICE):
        reason = leave_out.get(name) or left_out(name, set_key, quick, compile_sets)
        if reason is None:
            names.append(name)
        else:
            notes[name] = reason
    notes.update(NOT_INSTALLED)
    torch._dynamo.reset()  # no graph of an earlier test (another set, another optimizer) is reused or counted
    gc.collect()
    available = available_memory_bytes()
    first = param_sets.build(set_key, DEVICE, quick)
    shared = first if first.numel >= SHARED_FROM else None
    names, too_many = fit_in_memory(names, lambda name: held_buffers(name, base, shared is not None),
                                    4 * first.numel, LEAVE_FIRST, available, STEP_TEMPORARIES + 2 * (shared is not None))  # fmt: skip
    notes.update(too_many)
    unused = [first] if shared is None else []  # the first copy serves the first contender that needs one

    def copy_for(name: str) -> param_sets.ParamSet:
        if shared is not None and name in IN_PLACE:
            return shared
        return unused.pop() if unused else param_sets.build(set_key, DEVICE, quick)

    optimizers, steps, compile_timers, extra = {}, {}, {}, {name: {} for name in names}
    # our compiled rows first, each compiled in its warm-up right after it is built, then the compiled foreach SAM,
    # whose parity check steps it from the set's fresh weights (and builds a twin of the set, freed before the other
    # contenders take their memory); each compiled row must have compiled in its warm-up (below)
    for name in sorted(names, key=lambda n: (not n.endswith(COMPILED_STEP), n != COMPILED)):
        params = copy_for(name)
        optimizers[name], step = make(name, base, params.model)
        if name == COMPILED:  # the same step as ours, or no rows
            extra[name].update(compiled_parity(optimizers[name], params.params, set_key, base, quick))
            diff = extra[name]["max_rel_diff"]
            assert diff <= FP32_STEP_RTOL, f"{name} differs from our SAM: {diff}"
            gc.collect()
        if name.endswith(CUDA_GRAPH):
            extra[name]["capture_s"] = step.capture_s
        if compiles(name):  # the compiled rows' CompileTimer: the compiled foreach SAM's own, or our compiled step's
            compile_timers[name] = optimizers[name]._timer if name in (COMPILED, COMPILED_CAPTURED) else step.timer

        def synchronised(step=step):
            step()
            synchronize()

        steps[name] = synchronised
        if name.endswith(COMPILED_STEP):
            settle(name, synchronised, compile_timers[name])
    timers = {name: (timer, timer.compile_s) for name, timer in compile_timers.items() if name.endswith(COMPILED_STEP)}
    for name in names:
        if name.endswith(COMPILED_STEP):
            continue  # warmed up and settled when it was built
        # kernel compilation, allocator, re-homing of the gradients, the optimizer's state (a quick run only
        # smoke-tests)
        warm_up(steps[name])
        if name in compile_timers:
            settle(name, steps[name], compile_timers[name])
            timers[name] = compile_timers[name], compile_timers[name].compile_s
    for name in names:
        opt = optimizers[name]
        if isinstance(opt, SharpnessAware):  # not timing: the row must measure the path its name says
            expected = "per-tensor" if name.endswith(PER_TENSOR) else "fused"
            assert opt.base_step_mode == expected, f"{name}: {opt.base_step_mode} ({opt.base_step_reason})"
            extra[name]["base_step_mode"] = opt.base_step_mode
        if DEVICE == "cuda":
            extra[name]["launches"] = cuda_launches(steps[name])
            extra[name]["cuda_event_median_ms"] = cuda_event_median_ms(steps[name])
    rounds = step_rounds(first.numel, quick)
    seconds, samples = step_in_turn(steps, rounds, floor)
    for name, (timer, compiled) in timers.items():
        assert timer.compile_s == compiled, f"{name} compiled again while it was timed"
        extra[name].update(compile_s=compiled, compile_cache_hits=timer.cache["hits"],
                           compile_cache_misses=timer.cache["misses"])  # fmt: skip
    ratios = interleaved_fields({name: [1e3 * t for t in seconds[name]] for name in names}, REFERENCES, OVER)
    numel = first.numel
    for name in names:
        bare = name in (BARE, BARE_FUSED)
        counted = (BARE_BYTES_PER_PARAM if bare else BYTES_PER_PARAM)[base] * numel
        read_only = (0 if bare else ENERGY_BYTES) * numel
        record_rounds(
            seconds[name], set=first.name, base=base, contender=name, parameters=numel, tensors=len(first.params),
            bytes_counted=counted, base_flags=base_flags(name), stepped_in_turn=names, left_out=notes,
            shared_copy=shared is not None and name in IN_PLACE, **ratios[name], **extra[name],
            **floor.fields(counted, seconds[name], numel, name, read_only, samples),
        )  # fmt: skip


class FamilyRounds(NamedTuple):
    """One SAM-family variant's steps taken in turn within each round (:func:`family_rounds`)."""

    plan: contenders.FamilySteps
    params: param_sets.ParamSet  # the set's first copy: its name and sizes
    optimizers: dict
    seconds: dict[str, list[float]]
    samples: list  # the memory floor's measurements around the rounds
    ratios: dict[str, dict]
    shared: bool  # whether the peer's paths share one copy of the set

    def fields(self, row: str) -> dict:
        """Row ``row``'s fields of the rounds: what stepped in them, what was left out, its ratios."""
        shared = self.shared and self.plan.steps[row][1] in contenders.PEER_PATHS
        return {"stepped_in_turn": list(self.plan.steps), "left_out": self.plan.left_out, "shared_copy": shared,
                **self.ratios[row]}  # fmt: skip


def family_rounds(plan: contenders.FamilySteps, quick: bool, floor, build, state_buffers: int = 0) -> FamilyRounds:
    """Every step of ``plan`` built by ``build(variant, contender, params)`` on a copy of the family's set of its own
    (the same weights and gradients; from :data:`SHARED_FROM` parameters the peer's paths, which update the tensors in
    place, share one), warmed up, then stepped in turn within each round (``conftest.step_in_turn``), with the rows'
    ratios of the same rounds (``rows.family_fields``). ``state_buffers``: buffers of the set's size the base
    optimizer's state holds. Every step is a row or a yardstick of one, so none is left out alone: a variant whose
    steps would not fit in memory together is skipped (``conftest.fit_in_memory``), as one with no row here."""
    if not plan.rows:
        pytest.skip("; ".join(dict.fromkeys(plan.left_out.values())))
    gc.collect()
    available = available_memory_bytes()
    first = param_sets.build(contenders.FAMILY_SET_KEY, DEVICE, quick)
    shared = first if first.numel >= SHARED_FROM else None

    def in_place(key: str) -> bool:
        return shared is not None and plan.steps[key][1] in contenders.PEER_PATHS

    def held_buffers(key: str) -> int:  # its copy (none where shared), its backup, up to two of the variant's, state
        return (0 if in_place(key) else 2) + 3 + state_buffers

    fit_in_memory(list(plan.steps), held_buffers, 4 * first.numel, (), available,
                  STEP_TEMPORARIES + 2 * (shared is not None))  # fmt: skip
    unused = [first] if shared is None else []
    optimizers, steps = {}, {}
    for key, (variant, contender) in plan.steps.items():
        if in_place(key):
            params = shared
        else:
            params = unused.pop() if unused else param_sets.build(contenders.FAMILY_SET_KEY, DEVICE, quick)
        optimizers[key] = build(variant, contender, params)
        steps[key] = sam_step_of(optimizers[key])
        warm_up(steps[key])  # kernel compilation, allocator, re-homing of the gradients, the optimizer's state
    seconds, samples = step_in_turn(steps, step_rounds(first.numel, quick), floor)
    ratios = family_fields({key: [1e3 * t for t in s] for key, s in seconds.items()}, plan.own, plan.peer)
    return FamilyRounds(plan, first, optimizers, seconds, samples, ratios, shared is not None)


def cuda_fields(opt) -> dict:
    """On CUDA, the kernels one whole step of ``opt`` launches and its median by CUDA events; nothing elsewhere."""
    if DEVICE != "cuda":
        return {}

    def step():
        opt.first_step()
        opt.second_step()

    return {"launches": cuda_launches(step), "cuda_event_median_ms": cuda_event_median_ms(step)}


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("variant", list(contenders.FAMILY))
def test_family_whole_step(record_rounds, quick, floor, leave_out, variant, base):
    plan = contenders.family_steps(variant, DEVICE, quick, leave_out, base)
    cls, kwargs = BASES[base]
    ours = {"base_step": "fused", "foreach": True}  # the peer builds its base optimizer with foreach= its path

    def build(name: str, contender: str, params: param_sets.ParamSet):
        return contenders.make_variant(name, contender, params.model, params.partition, cls, rho=RHO, ours=ours,
                                       **kwargs)  # fmt: skip

    done = family_rounds(plan, quick, floor, build, STATE_BUFFERS[base])
    for key, opt in done.optimizers.items():  # the rows and their yardsticks: the path the names say
        if isinstance(opt, SharpnessAware):
            assert opt.base_step_mode == "fused", f"{key}: {opt.base_step_mode} ({opt.base_step_reason})"
    v, numel = contenders.FAMILY[variant], done.params.numel
    counted = (BYTES_PER_PARAM[base] + v.extra_bytes - v.folded_bytes) * numel
    read_only = (ENERGY_BYTES + v.read_only_bytes) * numel
    for contender in plan.rows:
        opt = done.optimizers[contender]
        mode = {"base_step_mode": opt.base_step_mode} if isinstance(opt, SharpnessAware) else {}
        record_rounds(
            done.seconds[contender], set=done.params.name, base=base, variant=variant, rule=v.rule,
            peer_variant=v.peer, plain_variant=v.plain, contender=contender, parameters=numel,
            tensors=len(done.params.params), bytes_counted=counted, **done.fields(contender), **mode, **cuda_fields(opt),
            **floor.fields(counted, done.seconds[contender], numel, contender, read_only, done.samples),
        )  # fmt: skip
