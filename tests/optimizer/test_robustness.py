"""What users of SAM libraries most often find broken: odd parameters, changed models, resume in a new process,
torch.compile. Every case on every backend, against the reference where there is something to compare."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from gearsam_fused import GEARSAM, SAM, FriendlySAM, MomentumSAM
from gearsam_fused.models import ResNet

from conftest import ALL, CUDA, FP32_STEP_RTOL, SGD_KW, batches, flat, loss_fn, rel_err, sam_step, tiny_resnet


def twin_runs(make_model, backend, device, steps=3, rule=GEARSAM, **kwargs):
    """The same model and data through ``backend`` and through ``reference``: both parameter vectors after each step."""
    runs = []
    for name in (backend, "reference"):
        model = make_model().to(device)
        opt = rule(model, torch.optim.SGD, backend=name, **SGD_KW, **kwargs)
        trajectory = []
        for xy in batches(steps, device=device):
            sam_step(opt, model, xy)
            trajectory.append(flat(model))
        runs.append(trajectory)
    return runs


class SkipEmpty(nn.Module):
    """A zero-size layer in the graph: its (0, n) weight and bias get gradients of size 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Linear(192, 8)
        self.empty = nn.Linear(8, 0)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.features(x.flatten(1))
        return self.head(h) + self.empty(h).sum()


@pytest.mark.parametrize("backend,device", ALL)
def test_zero_size_parameters_are_carried_along(backend, device):
    ours, reference = twin_runs(SkipEmpty, backend, device, partition="tensor")
    for a, b in zip(ours, reference):
        assert rel_err(a, b) <= FP32_STEP_RTOL


@pytest.mark.parametrize("backend,device", ALL)
def test_sparse_gradients_raise_type_error_on_every_backend(backend, device):
    emb = nn.Embedding(10, 3, sparse=True).to(device)
    opt = SAM(emb.parameters(), torch.optim.SGD, lr=0.1, backend=backend)
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    with pytest.raises(
        TypeError,
        match=r"SAM does not support sparse gradients \(\"param_groups\[0\]\['params'\]\[0\]\" has a torch.sparse_coo grad\)",
    ):
        opt.first_step()


@pytest.mark.parametrize("backend,device", ALL)
def test_duplicate_parameters_are_refused(backend, device):
    layer = nn.Linear(2, 2).to(device)
    with pytest.raises(ValueError, match=r"parameter param_groups\[0\]\['params'\]\[0\] \(shape \(2, 2\); pass model= to "
                                         r"name it\) is passed twice \(in one param group or in two\)"):  # fmt: skip
        SAM(
            [{"params": [layer.weight]}, {"params": [layer.weight, layer.bias]}],
            torch.optim.SGD,
            lr=0.1,
            backend=backend,
        )
    with pytest.raises(ValueError, match=r"parameter param_groups\[0\]\['params'\]\[0\] \(shape \(2, 2\); pass model= to "
                                         r"name it\) is passed twice"):  # fmt: skip
        SAM([layer.weight, layer.bias, layer.weight], torch.optim.SGD, lr=0.1, backend=backend)


@pytest.mark.parametrize("backend,device", ALL)
def test_parameters_frozen_after_construction_are_left_alone(backend, device):
    runs = []
    for name in (backend, "reference"):
        model = tiny_resnet(device=device)
        opt = GEARSAM(model, torch.optim.SGD, backend=name, **SGD_KW)
        data = batches(4, device=device)
        sam_step(opt, model, data[0])
        model.layer1.requires_grad_(False)
        frozen = [p.detach().clone() for p in model.layer1.parameters()]
        for xy in data[1:]:
            sam_step(opt, model, xy)
        assert all(torch.equal(p, q) for p, q in zip(model.layer1.parameters(), frozen))
        runs.append(flat(model))
    assert rel_err(runs[0], runs[1]) <= 3 * FP32_STEP_RTOL  # three steps after the freeze


@pytest.mark.parametrize("backend,device", ALL)
def test_parameters_unfrozen_after_construction_are_reported(backend, device):
    model = tiny_resnet(device=device)
    model.fc.requires_grad_(False)
    opt = GEARSAM(model.parameters(), torch.optim.SGD, model=model, backend=backend, **SGD_KW)
    model.fc.requires_grad_(True)
    loss_fn(model, batches(1, device=device)[0]).backward()
    with pytest.raises(
        RuntimeError, match=r"'fc.weight' \(shape \(3, 8\)\) has a gradient but was frozen when the optimizer was built"
    ):
        opt.first_step()


REPLACEMENTS = {
    "dtype": lambda w: w.double(),
    "shape": lambda w: w.reshape(-1).clone(),
    "layout": lambda w: w.t().contiguous().t(),  # the same values and shape, strides (1, 3)
    "device": lambda w: w.cpu() if w.is_cuda else w.cuda(),
}
CHANGES = [
    pytest.param(change, marks=[pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")] if change == "device" else [])
    for change in REPLACEMENTS
]


#: The step that meets the replaced parameter: its optimizer, and whether it is replaced between the two passes.
REFUSING_STEPS = {
    "first_step": (GEARSAM, False),
    "F-SAM first_step": (FriendlySAM, False),  # the ascent rewrites the gradients: refused before it
    "second_step": (GEARSAM, True),  # the parameters hold w + eps, and keep it
    "MomentumSAM step": (MomentumSAM, False),  # the parameters hold the look-ahead point, and keep it
}


@pytest.mark.parametrize("when", list(REFUSING_STEPS))
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("backend,device", ALL)
def test_a_parameter_moved_cast_or_reshaped_after_construction_is_refused_by_name(backend, device, change, when):
    """The reference and the flat-buffer backends refuse a parameter whose ``.data`` became a tensor of another
    device, dtype, shape or memory layout after the optimizer was built, naming it, before the step changes a weight
    (the reference: nor a gradient): the base optimizer's state was made for the old tensor."""
    rule, between_passes = REFUSING_STEPS[when]
    model = tiny_resnet(device=device)
    opt = rule(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    first, second = batches(2, device=device)
    if rule is MomentumSAM:
        loss_fn(model, first).backward()
        opt.step()
        opt.zero_grad()
    else:
        sam_step(opt, model, first)
    loss_fn(model, second).backward()
    if between_passes:
        opt.first_step(zero_grad=True)
        loss_fn(model, second).backward()
    model.fc.weight.data = REPLACEMENTS[change](model.fc.weight.detach())
    weights = lambda: torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])  # noqa: E731
    before, grads = weights(), [p.grad.clone() for p in model.parameters()]
    step = opt.step if rule is MomentumSAM else opt.second_step if between_passes else opt.first_step
    with pytest.raises(RuntimeError, match=r"parameter 'fc.weight' was replaced by a tensor of another device, dtype"):
        step()
    assert torch.equal(weights(), before)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("backend,device", ALL)
def test_parameters_added_to_the_model_later_are_not_optimized(backend, device):
    """As with every torch optimizer, a parameter that was not passed in is not the optimizer's: not perturbed, not
    stepped, and its gradient does not enter any block's energy."""
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, backend=backend, **SGD_KW)
    model.extra = nn.Parameter(torch.ones(3, device=device))
    x, y = batches(1, device=device)[0]
    (loss_fn(model, (x, y)) + model.extra.sum()).backward()
    opt.first_step()
    energy_with_extra = opt.block_stats()["energy"]
    opt.second_step(zero_grad=True)
    assert torch.equal(model.extra.detach(), torch.ones(3, device=device))
    reference = tiny_resnet(device=device)
    ref_opt = GEARSAM(reference, torch.optim.SGD, backend="reference", **SGD_KW)
    loss_fn(reference, (x, y)).backward()
    ref_opt.first_step()
    torch.testing.assert_close(energy_with_extra, ref_opt.block_stats()["energy"], rtol=1e-6, atol=0)


def assert_steps_equal(opt, model, base, base_model, device):
    """Four steps of ``opt`` over ``model`` and of the plain ``base`` over ``base_model``: the same weights after each."""
    for xy in batches(4, device=device):
        sam_step(opt, model, xy)
        loss_fn(base_model, xy).backward()
        base.step()
        base.zero_grad()
        assert torch.equal(flat(model), flat(base_model))


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("rule", [SAM, GEARSAM])
def test_rho_zero_is_the_base_optimizer_exactly(rule, backend, device):
    model, base_model = tiny_resnet(device=device), tiny_resnet(device=device)
    opt = rule(model, torch.optim.SGD, rho=0.0, backend=backend, **SGD_KW)
    assert_steps_equal(opt, model, torch.optim.SGD(base_model.parameters(), **SGD_KW), base_model, device)
    assert opt.block_stats()["share"].eq(0).all()


@pytest.mark.parametrize("backend,device", ALL)
def test_rho_zero_with_the_base_optimizers_own_step_is_adamw_exactly(backend, device):
    """Where the base optimizer steps per tensor (the reference backend; ``base_step="per-tensor"`` elsewhere), rho = 0
    is torch's own AdamW bit for bit on every backend: the perturbation leaves every weight as it is and the restore
    puts back the same bits. (The fused AdamW: ``kernels/test_base_step.py``.)"""
    kw = dict(lr=1e-3, weight_decay=1e-2)
    model, base_model = tiny_resnet(device=device), tiny_resnet(device=device)
    opt = SAM(model, torch.optim.AdamW, rho=0.0, backend=backend, base_step="per-tensor", **kw)
    assert_steps_equal(opt, model, torch.optim.AdamW(base_model.parameters(), **kw), base_model, device)
    assert opt.base_step_mode == "per-tensor"


@pytest.mark.parametrize("backend,device", ALL)
def test_beta_zero_allocates_by_the_current_energy(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, rho=0.1, beta=0.0, backend=backend, **SGD_KW)
    for xy in batches(2, device=device):
        sam_step(opt, model, xy)
        stats = opt.block_stats()
        torch.testing.assert_close(stats["score"], stats["energy"], rtol=0, atol=0)  # s_b = e_b: no memory
        expected = 0.1 * stats["energy"] / stats["energy"].norm()
        torch.testing.assert_close(stats["radius"], expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("fill", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_gradient_skips_its_block_for_one_step(backend, device, fill):
    """GEAR-SAM: a block whose energy is not finite is not perturbed and leaves its EMA score as it was; the other
    blocks are perturbed as usual, w + eps stays finite, and the next step allocates over every block again."""
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    data = batches(3, device=device)
    sam_step(opt, model, data[0])
    ema = opt.block_stats()["score"]
    loss_fn(model, data[1]).backward()
    model.fc.weight.grad[0, 0] = fill
    head, body = (
        [p.detach().clone() for p in model.fc.parameters()],
        [p.detach().clone() for p in model.layer1.parameters()],
    )
    opt.first_step(zero_grad=True)
    stats = opt.block_stats()
    assert opt.block_names[-1] == "classifier" and stats["non_finite"].item() == 1
    assert stats["score"][-1] == ema[-1] and stats["radius"][-1] == 0 and stats["radius"][:-1].all()
    assert all(torch.equal(p, q) for p, q in zip(model.fc.parameters(), head))  # skipped, bit for bit
    assert not any(torch.equal(p, q) for p, q in zip(model.layer1.parameters(), body))  # perturbed
    assert flat(model).isfinite().all()
    loss_fn(model, data[1]).backward()
    opt.second_step(zero_grad=True)
    sam_step(opt, model, data[2])
    stats = opt.block_stats()
    assert stats["non_finite"].item() == 0 and stats["radius"].all() and stats["score"].isfinite().all()


@pytest.mark.parametrize("backend,device", ALL)
def test_a_non_finite_gradient_makes_sam_skip_its_perturbation(backend, device):
    model = tiny_resnet(device=device)
    opt = SAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    loss_fn(model, batches(1, device=device)[0]).backward()
    model.fc.weight.grad[0, 0] = float("inf")
    before = flat(model)
    opt.first_step()
    stats = opt.block_stats()
    assert torch.equal(flat(model), before) and not stats["radius"].any() and stats["non_finite"].item() == 1


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("optimizer", [SAM, GEARSAM])
def test_non_finite_steps_match_the_reference(backend, device, optimizer):
    """Every backend skips exactly what the reference skips."""
    perturbed = []
    for name in (backend, "reference"):
        model = tiny_resnet(device=device)
        opt = optimizer(model, torch.optim.SGD, rho=0.05, backend=name, **SGD_KW)
        loss_fn(model, batches(1, device=device)[0]).backward()
        model.layer1[0].conv1.weight.grad[0, 0, 0, 0] = float("nan")
        opt.first_step()
        perturbed.append(flat(model))
        opt.second_step()
    assert perturbed[0].isfinite().all()
    torch.testing.assert_close(perturbed[0], perturbed[1], rtol=1e-6, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["reference", "torch", "cpp", "auto"])
def test_parameters_on_two_devices(backend):
    """A model split across the CPU and a GPU: one flat buffer per device, energies gathered on the first device."""
    runs = []
    for name in (backend, "reference"):
        torch.manual_seed(0)
        first, second = nn.Linear(6, 5), nn.Linear(5, 3).cuda()
        params = [*first.parameters(), *second.parameters()]
        opt = GEARSAM(params, torch.optim.SGD, partition="tensor", backend=name, **SGD_KW)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)

            def loss():
                return nn.functional.cross_entropy(second(first(x).cuda()), y.cuda())

            loss().backward()
            opt.first_step(zero_grad=True)
            loss().backward()
            opt.second_step(zero_grad=True)
        runs.append(torch.cat([p.detach().cpu().flatten() for p in params]))
    assert rel_err(runs[0], runs[1]) <= 3 * FP32_STEP_RTOL


RESUME_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import SGD_KW, batches, flat, sam_step, tiny_resnet
    from gearsam_fused import GEARSAM
    saved = torch.load({path!r})
    model = tiny_resnet(seed=99)  # different initial weights: everything must come from the checkpoint
    model.load_state_dict(saved["model"])
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend={backend!r}, **SGD_KW)
    opt.load_state_dict(saved["optimizer"])
    for xy in batches(8)[4:]:
        sam_step(opt, model, xy)
    torch.save({{"weights": flat(model), "ema": opt.block_stats()["score"]}}, {out!r})
    """
)


@pytest.mark.heavy  # a process per case; the in-process resume tests cover every backend
@pytest.mark.parametrize("backend,device", [case for case in ALL if case.values[1] == "cpu"])
def test_resume_in_a_fresh_process_continues_bitwise(tmp_path, backend, device):
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    data = batches(8)
    for xy in data[:4]:
        sam_step(opt, model, xy)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "checkpoint.pt")
    for xy in data[4:]:
        sam_step(opt, model, xy)
    tests = str(__import__("pathlib").Path(__file__).parents[1])
    script = RESUME_SCRIPT.format(
        tests=tests, path=str(tmp_path / "checkpoint.pt"), backend=backend, out=str(tmp_path / "out.pt")
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = torch.load(tmp_path / "out.pt")
    assert torch.equal(resumed["weights"], flat(model))
    assert torch.equal(resumed["ema"], opt.block_stats()["score"])


def test_loading_a_state_of_other_parameters_fails_clearly():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, **SGD_KW)
    sam_step(opt, model, batches(1)[0])
    state = opt.state_dict()
    wider = GEARSAM(ResNet(blocks=(1, 1), width=6, num_classes=3, act="silu"), torch.optim.SGD, **SGD_KW)
    with pytest.raises(
        ValueError,
        match=r"block 'stem' parameter 0 \('conv1.weight'\) has shape \(6, 3, 3, 3\); the state was saved for \(4, 3, 3, 3\)",
    ):
        wider.load_state_dict(state)
    fewer = GEARSAM(model, torch.optim.SGD, partition="coarse", **SGD_KW)
    ours = state["param_groups"][0]["gearsam"]
    ours["shapes"][-1] = ours["shapes"][-1][:1]
    with pytest.raises(ValueError, match=r"block 'classifier' has 2 parameters; the state was saved for 1"):
        fewer.load_state_dict(state)


@pytest.mark.parametrize("backend", ["torch", "cpp", "reference"])
def test_compiled_model_follows_the_eager_trajectory(backend):
    """torch.compile on the model (dynamo's graph capture and AOT autograd, the layers that see the re-homed
    parameters); the optimizer is unchanged. The aot_eager backend runs the captured graph with eager kernels: torch
    2.13.0's inductor CPU code for this model computed a wrong gradient for the stride-2 1x1 shortcut convolution on an
    AVX2 machine, with no optimizer involved, which is not ours to test. Decomposed operations may round differently
    from eager, so the comparison allows float32 rounding growth over the steps."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = tiny_resnet()
        net = torch.compile(model, backend="aot_eager") if compiled else model
        opt = GEARSAM(net, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
        if compiled:
            assert opt.block_names == GEARSAM(model, torch.optim.SGD, lr=0.1).block_names
        for xy in batches(5):
            sam_step(opt, net, xy)
        runs.append(flat(model))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-6)


TRAINABLE_DTYPES_REFUSED = [torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", TRAINABLE_DTYPES_REFUSED, ids=str)
@pytest.mark.parametrize("backend,device", ALL)
def test_trainable_parameters_of_other_dtypes_are_refused_at_construction_by_name(backend, device, dtype):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)).to(device)
    model[1].weight = nn.Parameter(torch.zeros(2, 3, device=device).to(dtype))
    kind = str(dtype).removeprefix("torch.")
    with pytest.raises(TypeError, match=rf"parameter '1.weight' \(shape \(2, 3\)\) is {kind}: SAM and GEAR-SAM update "
                                        r"float32, float64, float16, bfloat16 parameters"):  # fmt: skip
        GEARSAM(model, torch.optim.SGD, lr=0.1, backend=backend)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool, torch.complex64], ids=str)
@pytest.mark.parametrize("backend,device", ALL)
def test_frozen_parameters_of_any_dtype_are_left_alone(backend, device, dtype):
    """As torch's optimizers leave them: they get no gradient, so no step touches them."""
    model = tiny_resnet(device=device)
    model.register_parameter("table", nn.Parameter(torch.ones(5, device=device).to(dtype), requires_grad=False))
    twin = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, backend=backend, **SGD_KW)
    reference = GEARSAM(twin, torch.optim.SGD, backend="reference", **SGD_KW)
    for xy in batches(2, device=device):
        sam_step(opt, model, xy)
        sam_step(reference, twin, xy)
    assert torch.equal(model.table, torch.ones(5, device=device).to(dtype))
    assert rel_err(flat_trainable(model), flat(twin)) <= 2 * FP32_STEP_RTOL


def flat_trainable(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("backend,device", ALL)
def test_a_parameter_is_named_by_its_place_in_every_message_without_a_model(backend, device):
    a, b = nn.Parameter(torch.ones(3, device=device)), nn.Parameter(torch.ones(2, device=device))
    opt = SAM([{"params": [a]}, {"params": [b], "lr": 0.05}], torch.optim.SGD, lr=0.1, backend=backend)
    assert [n for block in opt.blocks for n in block.param_names] == [
        "param_groups[0]['params'][0]",
        "param_groups[1]['params'][0]",
    ]
    if opt.backend.fuses_base_step:
        a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
        opt.first_step(zero_grad=True)
        a.grad = torch.ones_like(a)  # b has no gradient at w + eps: torch's optimizer skips it, so no fused step
        opt.second_step()
        assert (
            opt.base_step_reason
            == "parameter \"param_groups[1]['params'][0]\" has no gradient: torch's optimizer skips it this step"
        )


def test_an_optimizer_instance_as_base_is_named_by_its_class():
    model = tiny_resnet()
    with pytest.raises(TypeError) as caught:
        SAM(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert str(caught.value).endswith("got an instance of SGD")


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("backend,device", ALL)
def test_second_step_without_a_second_backward_is_an_error(backend, device, set_to_none):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, backend=backend, **SGD_KW)
    xy = batches(1, device=device)[0]
    before = flat(model)
    loss_fn(model, xy).backward()
    opt.first_step()
    opt.zero_grad(set_to_none=set_to_none)
    with pytest.raises(RuntimeError, match=r"second_step\(\) found no gradient computed at w \+ eps.*restored to w and "
                                           "no step was taken"):  # fmt: skip
        opt.second_step()
    assert not opt.perturbed and torch.equal(flat(model), before)
    # the same protocol with the second backward goes through, as it always did
    loss_fn(model, xy).backward()
    opt.first_step()
    opt.zero_grad(set_to_none=set_to_none)
    loss_fn(model, xy).backward()
    opt.second_step()
    assert not torch.equal(flat(model), before)


@pytest.mark.parametrize("backend,device", ALL)
def test_a_closure_without_backward_cancels_the_whole_step(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, backend=backend, **SGD_KW)
    data = batches(2, device=device)
    sam_step(opt, model, data[0])
    before, ema = flat(model), opt.block_stats()["score"]
    loss_fn(model, data[1]).backward()
    with pytest.raises(RuntimeError, match="no gradient computed at w \\+ eps"):
        opt.step(lambda: loss_fn(model, data[1]))  # forgot .backward()
    assert torch.equal(flat(model), before) and torch.equal(opt.block_stats()["score"], ema)
