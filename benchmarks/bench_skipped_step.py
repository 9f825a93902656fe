"""A step a schedule skips against the base optimizer's step alone.

Under a schedule (``gearsam_fused.Every(k)``, ``LookSAM(k)``, ...) most steps take no second pass: ``first_step``
returns False after reading the gradient once for its energies (GEAR-SAM's EMA, the schedule's statistic) and making
the base optimizer's update from the current weights, fused over the flat buffers (LookSAM: with ``g + c_b * g_v``,
the stored orthogonal part of the last SAM gradient, read in the same pass). Such a step should cost about what the
base optimizer's own step costs. This benchmark measures that on the CIFAR ResNet-18 set, with SGD (momentum 0.9,
weight decay 5e-4) and AdamW (weight decay 0.01) as in :mod:`bench_whole_step`.

Contenders, for each of our backends that runs here (``torch``, ``cpp``; ``triton`` on CUDA):

=======================================  ==============================================================================
``BACKEND, SAM every-k, skipped step``   ``SAM(..., schedule=Every(k))``, ``first_step()`` on a step it skips
``BACKEND, GEAR-SAM every-k, ...``       the same with GEAR-SAM (its EMA takes the energies on every step)
``BACKEND, SAM LookSAM, skipped step``   ``schedule=LookSAM(k)``: the update with LookSAM's correction
``BACKEND, GEAR-SAM LookSAM, ...``       the same with GEAR-SAM (the correction's scale per block)
``bare base step``                       the base optimizer's ``step()`` alone (``foreach=True``), as in the whole step
=======================================  ==============================================================================

Only skipped steps are timed: each optimizer is built with ``k = 10**9``, takes its step 0 (always a SAM step) before
the warm-up, with a second gradient drawn independently of the first so that LookSAM's stored direction is not zero,
and every timed call is a ``first_step()`` that must return False (the benchmark fails otherwise) on the fused path.
Which steps a schedule skips depends on the step count alone, and a skipped step of ``Every(5)`` does the same work as
one of ``Every(10**9)``: whole cycles are the training-step benchmark's business.

Every round also times, just before the contender's step, one bare base step on a second copy of the set (its own
weights, gradients and state), so each row carries the ratio to the bare step of the same moment (median and quartiles
over the rounds) as well as the ratio of the medians: this shared machine's load drifts between rows.

Counted bytes per parameter (float32), a skipped step's floor: the energy pass reads g (4); the fused update reads w, g
and the state and writes w and the state: SGD with momentum 20, AdamW 28; LookSAM adds the read of g_v (4). So 24 / 32
for every-k, 28 / 36 for LookSAM, and the bare base step's own floor 20 / 28 (torch's ``foreach`` step moves more).
"""

from __future__ import annotations

import pytest
import torch
from bench_whole_step import BARE, BARE_FUSED, BASES, OUR_BACKENDS, RHO
from bench_whole_step import make as make_whole_step

from gearsam_fused import GEARSAM, SAM, Every, LookSAM

import contenders
import param_sets
from conftest import DEVICE, ENERGY_BYTES, PairedRounds, cuda_event_median_ms, cuda_launches, synchronize, warm_up

SET_KEY = "resnet18"  # CIFAR ResNet-18's shapes: 11.2M parameters in 62 tensors (quick mode: about a million)
NEVER = 10**9  # k of the schedules: after step 0 every step is skipped
UPDATE_BYTES = {"SGD": 20, "AdamW": 28}  # the fused update: w, g, state in; w, state out
CORRECTION_BYTES = 4
SCHEDULES = {"every-k": Every(NEVER), "LookSAM": LookSAM(NEVER)}
RULES = {"SAM": SAM, "GEAR-SAM": GEARSAM}
SKIPPED = ", skipped step"


def skipped_step_contenders(device: str) -> list[str]:
    usable = contenders.available(device)
    names = [f"{backend}, {rule} {schedule}{SKIPPED}" for backend in OUR_BACKENDS if backend in usable
             for rule in RULES for schedule in SCHEDULES]  # fmt: skip
    return [*names, BARE, *([BARE_FUSED] if device == "cuda" else [])]


def bytes_per_param(contender: str, base: str) -> int:
    """The floor of the row's step: the update alone for the bare base step; plus the energy pass for a skipped step,
    plus the correction's read under LookSAM."""
    if contender in (BARE, BARE_FUSED):
        return UPDATE_BYTES[base]
    return ENERGY_BYTES + UPDATE_BYTES[base] + (CORRECTION_BYTES if " LookSAM" in contender else 0)


def make(name: str, base: str, params: param_sets.ParamSet):
    """(optimizer, step) for contender ``name``: ours after their step 0, so that every ``step()`` is a skipped one."""
    if name in (BARE, BARE_FUSED):
        return make_whole_step(name, base, params.model)
    backend, _, rest = name.partition(", ")
    rule, schedule = rest.removesuffix(SKIPPED).split(" ")
    cls, kwargs = BASES[base]
    blocks = {"partition": params.partition} if RULES[rule] is GEARSAM else {}
    opt = RULES[rule](params.model, cls, rho=RHO, backend=backend, base_step="fused", schedule=SCHEDULES[schedule],
                      foreach=True, **blocks, **kwargs)  # fmt: skip
    # step 0, a SAM step; an independent second gradient leaves LookSAM a non-zero orthogonal part g_v to add later
    if not opt.first_step():
        raise AssertionError(f"{name}: step 0 must be a SAM step")
    generator = torch.Generator(device=DEVICE).manual_seed(123)
    with torch.no_grad():
        for p in params.params:
            p.grad.copy_(torch.randn(p.shape, device=DEVICE, generator=generator))
    opt.second_step()

    def step():
        if opt.first_step():
            raise AssertionError(f"{name}: a step the schedule should skip took the second pass")

    return opt, step


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("contender", skipped_step_contenders(DEVICE))
def test_skipped_step(benchmark, record, quick, floor, contender, base):
    params = param_sets.build(SET_KEY, DEVICE, quick)
    opt, step = make(contender, base, params)
    # the bare base step of each round runs on a copy of its own: the contender's weights and state stay its own
    _, bare_step = make_whole_step(BARE, base, param_sets.build(SET_KEY, DEVICE, quick, seed=1).model)
    ours = contender not in (BARE, BARE_FUSED)  # SAM or GEARSAM

    def synchronised_step():
        step()
        synchronize()

    def synchronised_bare():
        bare_step()
        synchronize()

    warm_up(synchronised_step)
    bare = PairedRounds(synchronised_bare)  # each round's bare base step, just before the contender's step
    extra = {}
    if ours:  # not timing: the row must measure the fused path its name says
        assert opt.base_step_mode == "fused", f"{contender}: {opt.base_step_mode} ({opt.base_step_reason})"
        assert opt.sam_step is False and opt.step_statistics.sam_step is False
        extra["base_step_mode"] = opt.base_step_mode
    if DEVICE == "cuda":
        extra["launches"] = cuda_launches(step)
        extra["cuda_event_median_ms"] = cuda_event_median_ms(step)
    benchmark.group = f"skipped step, {base}, {params.name}, {DEVICE}"
    rounds = 3 if quick else max(5, min(60, int(6e8 / params.numel)))
    benchmark.pedantic(synchronised_step, setup=floor.interleaved(bare.setup), rounds=rounds, iterations=1)
    counted = bytes_per_param(contender, base) * params.numel
    read_only = (0 if contender in (BARE, BARE_FUSED) else ENERGY_BYTES) * params.numel  # the energy pass only reads
    fields = dict(
        set=params.name, base=base, contender=contender, parameters=params.numel, tensors=len(params.params),
        bytes_counted=counted, **floor.fields(counted, benchmark.stats.stats.data, params.numel, contender, read_only),
        **bare.fields(benchmark.stats.stats.data, "bare"), **extra,
    )  # fmt: skip
    benchmark.extra_info.update(fields)
    record(**fields)
