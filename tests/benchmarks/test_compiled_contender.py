"""The benchmarks' ``compiled foreach SAM`` contender (``benchmarks/contenders.py``: SAM and GEAR-SAM in
``torch._foreach_*`` operations under ``torch.compile``) takes the same steps as gearsam_fused's SAM and GEAR-SAM, so
that the benchmark times the same arithmetic: a few two-pass steps of a tiny model, both base optimizers, within the
suite's float32 tolerance per step; and a different ``rho`` lands outside it, so the comparison can fail."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gearsam_fused import GEARSAM, SAM, partition

from conftest import FP32_STEP_RTOL, flat, rel_err

pytestmark = pytest.mark.heavy  # a torch.compile a case: the default tier runs one

_spec = importlib.util.spec_from_file_location(
    "benchmarks_test_contenders", Path(__file__).resolve().parents[2] / "benchmarks" / "contenders.py"
)
contenders = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = contenders  # torch.compile looks the compiled method's module up by name
_spec.loader.exec_module(contenders)

STEPS = 3
BASES = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
}


def _model() -> torch.nn.Module:
    """Three layers, six tensors, three "coarse" blocks: compiling for it takes seconds, not minutes."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.SiLU(), torch.nn.Linear(16, 16), torch.nn.SiLU(),
                               torch.nn.Linear(16, 3))  # fmt: skip


def _two_pass_step(opt, model, x, y):
    for step in (opt.first_step, opt.second_step):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        step()


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("rule", ["sam", "gear-sam"])
def test_compiled_contender_takes_our_steps(rule, base):
    """:data:`STEPS` steps on identical models and batches: the contender, ours with the same rho, and ours with a
    rho twice as large (the negative control, outside the tolerance by far)."""
    cls, kwargs = BASES[base]
    models = [_model() for _ in range(3)]
    blocks = [block.params for block in partition(models[0], "coarse")]
    compiled = contenders.CompiledForeachSAM(blocks, cls, rho=0.05, rule=rule, beta=0.9, **kwargs)
    ours_cls, blocked = (SAM, {}) if rule == "sam" else (GEARSAM, {"partition": "coarse", "beta": 0.9})
    ours = [ours_cls(m, cls, rho=rho, backend="torch", foreach=True, **blocked, **kwargs)
            for m, rho in zip(models[1:], (0.05, 0.1))]  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(32, 12, generator=g), torch.randint(0, 3, (32,), generator=g)
        for opt, model in zip([compiled, *ours], models):
            _two_pass_step(opt, model, x, y)
    theirs, same, other = map(flat, models)
    tolerance = FP32_STEP_RTOL * STEPS
    assert rel_err(theirs, same) <= tolerance
    assert rel_err(theirs, other) > 10 * tolerance  # the check can fail
    assert compiled.compile_s > 0  # the first calls compiled, and were counted


def test_the_captured_contender_takes_the_same_steps_and_keeps_the_others_compiled_code():
    """``mode="reduce-overhead"`` (CUDA graphs on a GPU; on a CPU inductor compiles as by default): the same steps as
    ours; built with ``reset=False`` after another instance, it leaves that instance's compiled code in place (a reset
    would make it compile again), as the benchmarks that step several compiled contenders in turn need."""
    cls, kwargs = BASES["SGD"]
    models = [_model() for _ in range(3)]
    first = contenders.CompiledForeachSAM(list(models[0].parameters()), cls, rho=0.05, **kwargs)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 12, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(STEPS)]
    for x, y in batches[:2]:  # the first steps compile: the new state's step and then a settled one
        _two_pass_step(first, models[0], x, y)
    compiled = first.compile_s
    captured = contenders.CompiledForeachSAM(list(models[1].parameters()), cls, rho=0.05, mode="reduce-overhead",
                                             reset=False, **kwargs)  # fmt: skip
    ours = SAM(models[2], cls, rho=0.05, backend="torch", foreach=True, **kwargs)
    for x, y in batches:
        for opt, model in ((captured, models[1]), (ours, models[2])):
            _two_pass_step(opt, model, x, y)
    _two_pass_step(first, models[0], *batches[2])
    assert first.compile_s == compiled  # nothing of the first instance compiled again
    assert rel_err(flat(models[1]), flat(models[2])) <= FP32_STEP_RTOL * STEPS and captured.compile_s > 0
