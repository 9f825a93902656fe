"""The ``sharded`` backend on plain tensors: the reference backend's formulas over temporary flat copies, tensors left
in place. (On FSDP2's shards: test_fsdp.py.)"""

import copy

import pytest
import torch

from gearsam_fused import GEARSAM, SAM

from conftest import FP32_STEP_RTOL, FP64_STEP_RTOL, SGD_KW, batches, flat, loss_fn, rel_err, sam_step, tiny_resnet

STEPS = 30
RTOL = {torch.float32: FP32_STEP_RTOL, torch.float64: FP64_STEP_RTOL}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    "cls,kw", [(SAM, {}), (GEARSAM, {}), (GEARSAM, {"partition": "tensor"})], ids=["sam", "gear", "gear-tensor"]
)
@pytest.mark.parametrize("adaptive", [False, True], ids=["plain", "adaptive"])
def test_trajectory_matches_reference(cls, kw, adaptive, dtype):
    """The same formulas element for element; the energies are summed in another order (per-tensor segment sums), so
    float64 steps agree to rounding, float32 ones usually bit for bit."""
    model = tiny_resnet(dtype=dtype)
    ref_model = copy.deepcopy(model)
    hp = dict(rho=0.05, adaptive=adaptive, eta=0.01, **kw, **SGD_KW)
    opt = cls(model, torch.optim.SGD, backend="sharded", **hp)
    ref = cls(ref_model, torch.optim.SGD, backend="reference", **hp)
    start = flat(model)
    for xy in batches(STEPS, dtype):
        sam_step(opt, model, xy)
        sam_step(ref, ref_model, xy)
        assert rel_err(flat(model), flat(ref_model)) <= RTOL[dtype]
        torch.testing.assert_close(opt.block_stats()["energy"], ref.block_stats()["energy"], rtol=1e-12, atol=0)
    assert rel_err(flat(model), start) > 1e-3  # the run really moved


def test_parameters_stay_where_they_are_and_restore_is_exact():
    model = tiny_resnet()
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend="sharded", **SGD_KW)
    before = flat(model)
    loss_fn(model, batches(1)[0]).backward()
    opt.first_step(cancellable=True)
    assert not torch.equal(flat(model), before)
    opt.cancel_step()
    assert torch.equal(flat(model), before)
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    assert opt.base_step_mode == "per-tensor" and "backend 'sharded'" in opt.base_step_reason


def test_a_block_with_a_non_finite_gradient_stays_exactly_where_it_is():
    """As the reference: GEAR-SAM gives such a block no radius, and its weights are kept, not set to inf * 0."""
    runs = []
    for backend in ("sharded", "reference"):
        model = tiny_resnet()
        opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
        loss_fn(model, batches(1)[0]).backward()
        model.fc.weight.grad[0, 0] = float("inf")
        before = model.fc.weight.detach().clone()
        opt.first_step()
        assert torch.equal(model.fc.weight, before)
        runs.append(flat(model))
    assert torch.equal(*runs)


class TwoDtypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 3).double()

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).double())


def test_two_dtypes_and_a_parameter_without_a_gradient_match_the_reference():
    torch.manual_seed(0)
    model = TwoDtypes()
    ref_model, start = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(5, 6)
    opt, ref = (GEARSAM(m, torch.optim.SGD, rho=0.05, partition="tensor", backend=b, **SGD_KW)
                for m, b in ((model, "sharded"), (ref_model, "reference")))  # fmt: skip
    for m, o in ((model, opt), (ref_model, ref)):
        m(x).square().sum().backward()
        m.body.bias.grad = None  # no gradient this step: skipped, as the reference skips it
        o.first_step()
    # the two sum a block's energy in different orders (torch's reductions vectorise by the CPU's width), so the
    # perturbations agree to each dtype's tolerance, not bit for bit
    for (name, p), q, s in zip(model.named_parameters(), ref_model.parameters(), start.parameters()):
        if name != "body.bias":
            rtol = FP64_STEP_RTOL if p.dtype == torch.float64 else FP32_STEP_RTOL
            assert rel_err(p.detach() - s, q.detach() - s) <= rtol, name
    assert not torch.equal(model.head.weight, start.head.weight)  # perturbed
    assert torch.equal(model.body.bias, start.body.bias)  # no gradient, not perturbed
    assert torch.equal(ref_model.body.bias, start.body.bias)
