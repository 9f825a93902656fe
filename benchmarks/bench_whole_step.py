"""The whole optimizer step: ``first_step`` + ``second_step``, including the base optimizer's update.

Where :mod:`bench_sam_step` times the SAM machinery alone (its base optimizer does nothing), this times what a
training loop pays for the optimizer: SAM's energy, perturbation and restore plus a real base step, torch's SGD with
momentum and weight decay or AdamW. gearsam_fused fuses the base step with the restore when it can (``base_step``);
the rows show what that fusion buys against the same backend stepping the base optimizer per tensor, against the
per-tensor implementations, and against the base optimizer's step alone.

Contenders, each around the same base optimizer (every torch optimizer with ``foreach=True``):

=============================  ====================================================================================
``per-tensor loop``            :class:`contenders.PerTensorLoopSAM`, then the base optimizer's ``step()``
``pytorch_optimizer``          ``pytorch_optimizer.SAM(..., foreach=True)`` (skipped with a note when not installed)
``pytorch_optimizer, per tensor``  the same with ``foreach=False`` (its default on CPU): the report compares with the
                               faster of its two paths and names it
``torch``, ``cpp``, ``triton``  gearsam_fused's SAM on that backend with ``base_step="fused"`` (``triton``: CUDA only)
``BACKEND, base per tensor``   the same with ``base_step="per-tensor"``: a flat restore, then the base ``step()``
``bare base step``             the base optimizer's ``step()`` alone, no SAM: the floor a SAM step is compared to
``bare base step (fused)``     the same with ``fused=True`` (CUDA only)
=============================  ====================================================================================

Counted bytes per step for d float32 parameters, the floor of a fused step: energy reads g (4d); perturb reads w and
g and writes the backup and w (16d); restore-and-update reads the backup, g and the optimizer's state and writes w
and the state: SGD with momentum 20d (backup, g, momentum buffer in; w, buffer out), AdamW 28d (backup, g, two
moments in; w, two moments out). So 40d for SGD and 48d for AdamW, the same yardstick for every contender (the bare
base step moves fewer). GB/s is that count over the median time, ``pct_copy`` compares it with the copy bandwidth
measured in the same run. On CUDA a row also records kernel launches per step (torch profiler) and the median by
CUDA events.

The sets are :data:`param_sets.WHOLE_STEP_SET_KEYS`; quick mode runs :data:`QUICK_SET_KEYS` only, with a shorter
warm-up: a smoke run, not a measurement.
"""

from __future__ import annotations

import pytest
import torch

from gearsam_fused import SAM

import contenders
import param_sets
from conftest import DEVICE, cuda_event_median_ms, cuda_launches, synchronize, warm_up

RHO = 0.05
#: base optimizer name -> (class, hyperparameters) and the bytes counted per parameter for a step with it
BASES = {
    "SGD": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
}
BYTES_PER_PARAM = {"SGD": 4 + 16 + 20, "AdamW": 4 + 16 + 28}
#: the sets of a quick run: a network's shapes and the two sets of many small tensors, where the fusion matters most
QUICK_SET_KEYS = ["resnet18", "small_tensors", "tensors_4096"]

LOOP = "per-tensor loop"
BARE, BARE_FUSED = "bare base step", "bare base step (fused)"
PER_TENSOR = ", base per tensor"  # suffix of our contenders that step the base optimizer per tensor
OUR_BACKENDS = ("torch", "cpp", "triton")
NOT_INSTALLED = contenders.not_installed()  # peers shown as skipped, with the note, instead of left out


def whole_step_contenders(device: str) -> list[str]:
    """The contenders that can run on ``device`` here, in the order the report lists them."""
    usable = contenders.available(device)  # leaves out triton on CPU and backends that are not built
    names = [name for name in (LOOP, *contenders.PEER_PATHS) if name in usable]
    for backend in OUR_BACKENDS:
        if backend in usable:
            names += [backend, backend + PER_TENSOR]
    return [*names, BARE, *([BARE_FUSED] if device == "cuda" else [])]


def make(name: str, base: str, model: torch.nn.Module):
    """(optimizer, step): contender ``name`` around the base optimizer ``base`` over ``model``'s parameters, and one
    whole step of it."""
    cls, kwargs = BASES[base]
    if name in (BARE, BARE_FUSED):
        flag = {"fused": True} if name == BARE_FUSED else {"foreach": True}
        opt = cls(model.parameters(), **kwargs, **flag)
        return opt, opt.step
    if name == LOOP:
        opt = contenders.PerTensorLoopSAM(model.parameters(), cls, rho=RHO, foreach=True, **kwargs)
    elif name in contenders.PEER_PATHS:
        import pytorch_optimizer

        opt = pytorch_optimizer.SAM(model.parameters(), cls, rho=RHO, foreach=contenders.PEER_PATHS[name], **kwargs)
    else:
        backend, per_tensor, _ = name.partition(PER_TENSOR)
        mode = "per-tensor" if per_tensor else "fused"  # "fused" fails at construction when it cannot be honoured
        opt = SAM(model, cls, rho=RHO, backend=backend, base_step=mode, foreach=True, **kwargs)

    def step():
        opt.first_step()
        opt.second_step()

    return opt, step


def pytest_generate_tests(metafunc):
    # the sets depend on --quick, known once the options are parsed
    if "set_key" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        metafunc.parametrize("set_key", QUICK_SET_KEYS if quick else param_sets.WHOLE_STEP_SET_KEYS)


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("contender", whole_step_contenders(DEVICE) + list(NOT_INSTALLED))
def test_whole_step(benchmark, record, quick, copy_bandwidth, contender, base, set_key):
    if contender in NOT_INSTALLED:
        pytest.skip(NOT_INSTALLED[contender])
    params = param_sets.build(set_key, DEVICE, quick)
    opt, step = make(contender, base, params.model)
    ours = isinstance(opt, SAM)

    def synchronised_step():
        step()
        synchronize()

    # kernel compilation, allocator, re-homing of the gradients, the optimizer's state (a quick run only smoke-tests)
    warm_up(synchronised_step, min_steps=2, min_seconds=0.1) if quick else warm_up(synchronised_step)
    extra = {}
    if ours:
        # not timing: the row must measure the path its name says, never silently the other one
        expected = "per-tensor" if contender.endswith(PER_TENSOR) else "fused"
        assert opt.base_step_mode == expected, f"{contender}: {opt.base_step_mode} ({opt.base_step_reason})"
        extra["base_step_mode"] = opt.base_step_mode
    if DEVICE == "cuda":
        extra["launches"] = cuda_launches(step)
        extra["cuda_event_median_ms"] = cuda_event_median_ms(step)
    benchmark.group = f"whole step, {base}, {params.name}, {DEVICE}"
    rounds = 3 if quick else max(5, min(30, int(3e8 / params.numel)))
    benchmark.pedantic(synchronised_step, rounds=rounds, iterations=1)
    counted = BYTES_PER_PARAM[base] * params.numel
    gbps = counted / benchmark.stats.stats.median / 1e9
    fields = dict(
        set=params.name, base=base, contender=contender, parameters=params.numel, tensors=len(params.params),
        bytes_counted=counted, gbps=gbps, copy_gbps=copy_bandwidth, pct_copy=100 * gbps / copy_bandwidth, **extra,
    )  # fmt: skip
    benchmark.extra_info.update(fields)
    record(**fields)
