"""MomentumSAM's optimizer step against the base optimizer's step alone: ours fused over the flat buffers, and torch's.

:class:`gearsam_fused.MomentumSAM` takes one gradient per step, at a look-ahead point along the base optimizer's
momentum. Its ``step()`` makes, per flat bucket on a fused backend, ``restore_and_update_`` (w put back from the
saved copy and the base optimizer's update in one pass, which on the kernel backends also sums the new momentum's
block energies tile by tile as it writes it; the ``torch`` backend reads the momentum again for them), the allocation
on the ``[B]`` blocks, and ``perturb_along_`` (the parameters and the momentum read, the saved copy and the look-ahead
point written). Against a plain optimizer it adds one pass to the update (two on ``torch``); this benchmark measures
what that costs at the speed our update alone runs at the same moments.

Contenders, each on its own copy of the set (the same seed: the same weights and gradients), around torch's SGD
(momentum 0.9, weight decay 5e-4) or AdamW (weight decay 0.01), every torch optimizer with ``foreach=True``:

==============================  =======================================================================================
``BACKEND, MomentumSAM``        ``MomentumSAM(model, base, backend=BACKEND, base_step="fused").step()`` (``cpp``,
                                ``torch``; ``triton`` on CUDA)
``BACKEND, fused base step``    our update alone over the flat buffers (:class:`contenders.FusedBaseStep`: the
                                backend's ``update_``, the update of a step a schedule skips, without its energy pass)
``BACKEND, SAM skipped step``   ``SAM(..., schedule=Every(10**9))``'s ``first_step()`` on a step it skips: the energy
                                pass and ``update_`` (the skipped-step benchmark's contender)
``bare base step``              torch's ``step()`` alone (``foreach=True``), as in the whole-step benchmark
==============================  =======================================================================================

Interleaved: a round measures the memory floor once (``conftest.MemoryFloor``), then steps every contender once, the
order turned by one place each round; each contender's step is timed alone (synchronised). A row's ratios are the
median and quartiles over the rounds of its time over another contender's in the same round, so the load of a shared
machine, which moves every contender of a round alike, stays out of them:

* ``over_base``: over our fused base step on the same backend (the ``bare base step``: on the first of our backends
  here, ``cpp`` where it is built);
* ``over_allowed`` (MomentumSAM): over the time its counted bytes take at the rate the fused base step reaches in the
  same round, i.e. ``over_base`` times the base step's bytes over MomentumSAM's: 1.0 is MomentumSAM moving its bytes
  as fast as the base step alone moves its own; ``over_allowed_skipped`` the same at the skipped step's rate;
* ``over_bare``: over torch's ``foreach`` step.

Counted bytes per float32 parameter: the update reads w (the saved copy), g and the state and writes w and the state,
SGD with momentum 20, AdamW 28; ``perturb_along_`` reads w and the momentum and writes the saved copy and w, 16; on the
``torch`` backend ``direction_energy`` reads the momentum once more, 4, read-only. MomentumSAM: 36 (SGD) and 44
(AdamW) on ``cpp`` and ``triton``, 40 and 48 on ``torch``, 4 of them read-only; the fused base step and the bare base
step the update's 20 and 28 (torch's ``foreach`` step moves more than that); the skipped step 24 and 32 (its energy
pass reads the gradients, 4, read-only). GB/s is a row's counted bytes over its median time; ``pct_floor`` and
``pct_traffic_floor`` compare it with the floor measured before each round, as in the other benchmarks.

The sets: ResNet-18's shapes (62 tensors) and 2048 small tensors (:mod:`param_sets`). Quick mode, a smoke run, scales
ResNet-18 to about a million parameters, runs the first of our backends only (``cpp`` where it is built) and takes 3
rounds.
"""

from __future__ import annotations

import pytest
import torch
from bench_whole_step import BARE, BASES, OUR_BACKENDS, RHO

from gearsam_fused import SAM, Every, MomentumSAM

import contenders
import param_sets
from conftest import DEVICE, ENERGY_BYTES, step_in_turn, synchronize, warm_up
from report import quartiles

SET_KEYS = ["resnet18", "small_tensors"]
#: the base optimizer's update: w, g and the state in; w and the state out
UPDATE_BYTES = {"SGD": 20, "AdamW": 28}
#: perturb_along_: w and the momentum in, the saved copy and w out
LOOK_AHEAD_BYTES = 16
#: the backends whose update sums the new momentum's energies as it writes it, reading nothing more
SUMMED_BY_THE_UPDATE = ("cpp", "triton")
NEVER = 10**9  # the skipped step's schedule: after its step 0, every step is skipped
MOMENTUM_SAM, FUSED_BASE, SKIPPED = "MomentumSAM", "fused base step", "SAM skipped step"


def momentum_step_contenders(device: str, quick: bool = False) -> list[str]:
    """The contenders that can run on ``device`` here, in the order the report lists them; a quick run (a smoke run)
    takes the first of our backends only."""
    usable = contenders.available(device)
    backends = [backend for backend in OUR_BACKENDS if backend in usable]
    backends.sort(key=lambda backend: backend != "cpp")  # the CPU's fastest first: the bare base step's yardstick
    backends = backends[:1] if quick else backends
    return [f"{backend}, {kind}" for backend in backends for kind in (MOMENTUM_SAM, FUSED_BASE, SKIPPED)] + [BARE]


def bytes_per_param(contender: str, base: str) -> tuple[int, int]:
    """(counted, read-only) bytes per parameter of the contender's step."""
    if contender.endswith(MOMENTUM_SAM):
        if contender.partition(", ")[0] in SUMMED_BY_THE_UPDATE:
            return UPDATE_BYTES[base] + LOOK_AHEAD_BYTES, 0
        return UPDATE_BYTES[base] + ENERGY_BYTES + LOOK_AHEAD_BYTES, ENERGY_BYTES
    if contender.endswith(SKIPPED):
        return ENERGY_BYTES + UPDATE_BYTES[base], ENERGY_BYTES
    return UPDATE_BYTES[base], 0


def make(name: str, base: str, model: torch.nn.Module):
    """(optimizer, step): contender ``name`` around the base optimizer ``base`` over ``model``'s parameters."""
    cls, kwargs = BASES[base]
    if name == BARE:
        opt = cls(model.parameters(), foreach=True, **kwargs)
        return opt, opt.step
    backend, _, kind = name.partition(", ")
    if kind == MOMENTUM_SAM:
        opt = MomentumSAM(model, cls, rho=RHO, backend=backend, base_step="fused", foreach=True, **kwargs)
        return opt, opt.step
    if kind == FUSED_BASE:
        opt = contenders.FusedBaseStep(model, cls, backend, rho=RHO, foreach=True, **kwargs)
        return opt, opt.step
    opt = SAM(model, cls, rho=RHO, backend=backend, base_step="fused", schedule=Every(NEVER), foreach=True, **kwargs)
    if not opt.first_step():
        raise AssertionError(f"{name}: step 0 must be a SAM step")
    opt.second_step()

    def skipped_step():
        if opt.first_step():
            raise AssertionError(f"{name}: a step the schedule should skip took the second pass")

    return opt, skipped_step


def per_round(numerator: list[float], denominator: list[float], scale: float = 1.0) -> tuple[float, float, float]:
    """Quartiles over the rounds of ``numerator / (scale * denominator)``, round by round."""
    return quartiles([a / (scale * b) for a, b in zip(numerator, denominator, strict=True)])


def ratio_fields(name: str, ratios: tuple[float, float, float]) -> dict[str, float]:
    q1, median, q3 = ratios
    return {name: median, f"{name}_q1": q1, f"{name}_q3": q3}


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("set_key", SET_KEYS)
def test_momentum_step(record_rounds, quick, floor, set_key, base):
    names = momentum_step_contenders(DEVICE, quick)
    steps, optimizers = {}, {}
    for name in names:
        params = param_sets.build(set_key, DEVICE, quick)  # the same weights and gradients for every contender
        optimizers[name], step = make(name, base, params.model)

        def synchronised(step=step):
            step()
            synchronize()

        steps[name] = synchronised
    for step in steps.values():
        warm_up(step)
    for name, opt in optimizers.items():  # not timing: a row of ours must measure the fused path
        if name != BARE:
            assert opt.base_step_mode == "fused", f"{name}: {opt.base_step_mode}"
    rounds = 3 if quick else 40
    seconds, samples = step_in_turn({name: steps[name] for name in names}, rounds, floor)
    first_backend = names[0].split(", ")[0]
    for name in names:
        backend = None if name == BARE else name.split(", ")[0]
        yardstick = f"{backend or first_backend}, {FUSED_BASE}"
        counted, read_only = bytes_per_param(name, base)
        extra = ratio_fields("over_base", per_round(seconds[name], seconds[yardstick]))
        extra.update(ratio_fields("over_bare", per_round(seconds[name], seconds[BARE])))
        if name.endswith(MOMENTUM_SAM):
            base_bytes = bytes_per_param(yardstick, base)[0]
            skipped = f"{backend}, {SKIPPED}"
            extra.update(
                ratio_fields("over_allowed", per_round(seconds[name], seconds[yardstick], counted / base_bytes))
            )
            extra.update(ratio_fields("over_allowed_skipped", per_round(
                seconds[name], seconds[skipped], counted / bytes_per_param(skipped, base)[0])))  # fmt: skip
        if backend is not None:
            extra["base_step_mode"] = optimizers[name].base_step_mode
        numel, tensors = params.numel, len(params.params)
        record_rounds(
            seconds[name], set=params.name, base=base, contender=name, backend=backend, parameters=numel,
            tensors=tensors, bytes_counted=counted * numel, yardstick=yardstick, **extra,
            **floor.fields(counted * numel, seconds[name], numel, name, read_only * numel, samples),
        )  # fmt: skip
