"""``capturable=True``: rho, the lrs and the step counts on the device, an overflowing step skipped there.

On the CPU the logic is checked against the default optimizer: the same weights, optimizer state, step counts and GEAR
EMA, bit for bit (the kernels read from the device exactly the values the host passes otherwise), with an LR scheduler
and a changed rho on the way, after a checkpoint, and under ``SAMScaler`` with overflows forced into either pass. A
capturable step reads no value on the host (every reading method of a tensor is made to fail during the step). The
``cuda`` tests capture a ResNet-18 training step in a CUDA graph, replay it and compare it with eager steps.
"""

import contextlib
import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.amp import SAMScaler
from gearsam_fused.models import resnet18
from gearsam_fused.schedules import Every
from gearsam_fused.telemetry import BlockTelemetry

from conftest import CUDA, KERNELS, mlp, mlp_data, mse
from doc_blocks import needs_block

BASES = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)),
    "sgd-dampened": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),
    "sgd-plain": (torch.optim.SGD, dict(lr=0.1)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3)),
    "adamw-amsgrad": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
}
RULES = {"sam": (SAM, {}), "gear-sam": (GEARSAM, dict(partition="fine"))}
CPU_KERNELS = [case for case in KERNELS if case.values[1] == "cpu"]


def build(rule: str, base: str, backend: str, capturable: bool, model=None):
    model = mlp() if model is None else model
    cls, rule_kwargs = RULES[rule]
    base_cls, base_kwargs = BASES[base]
    opt = cls(model, base_cls, backend=backend, capturable=capturable, **rule_kwargs, **base_kwargs)
    return model, opt


def set_rho(opt, value: float) -> None:
    """As a user changes rho: assigned to a default optimizer, written into the tensor of a capturable one."""
    for group in opt.param_groups:
        if isinstance(group["rho"], torch.Tensor):
            group["rho"].fill_(value)
        else:
            group["rho"] = value


def train(model, opt, batches, scheduler=None, start: int = 0) -> None:
    """Steps ``start``, ``start + 1``, ... on ``batches``; rho changes at step 2."""
    for i, xy in enumerate(batches, start):
        if i == 2:
            set_rho(opt, 0.11)
        mse(model, xy).backward()
        opt.first_step(zero_grad=True)
        mse(model, xy).backward()
        opt.second_step(zero_grad=True)
        if scheduler is not None:
            scheduler.step()


def assert_same_run(a, b) -> None:
    """Weights, every state tensor (step counts by value) and the GEAR EMA bit for bit."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        state_a, state_b = opt_a.state[p], opt_b.state[q]
        assert state_a.keys() == state_b.keys()
        for key in state_a:
            assert torch.equal(state_a[key].cpu().double(), state_b[key].cpu().double()), key
    assert torch.equal(opt_a.step_statistics.ema, opt_b.step_statistics.ema)


@pytest.mark.parametrize("backend,device", CPU_KERNELS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("base", BASES)
def test_a_capturable_step_gives_the_bits_of_the_default(backend, device, rule, base):
    """Five steps with a StepLR halving lr every two steps and rho changed at the third."""
    runs = []
    for capturable in (False, True):
        model, opt = build(rule, base, backend, capturable)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        train(model, opt, mlp_data(5), scheduler)
        runs.append((model, opt))
    assert_same_run(*runs)
    capturable = runs[1][1]
    assert capturable.base_step_mode == "fused"
    lr = capturable.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == BASES[base][1]["lr"] * 0.25  # the scheduler wrote it
    assert capturable.step_statistics.rho.item() == 0.11


@pytest.mark.parametrize("base", ["sgd", "adam"])
def test_the_device_values_are_the_tensors_the_groups_hold(base):
    """A scheduler writes lr in place: the tensor a captured graph reads is the one the group holds, before and after
    a scheduler step and a checkpoint load."""
    model, opt = build("gear-sam", base, "cpp", True)
    lrs = [group["lr"] for group in opt.param_groups]
    rho = opt.param_groups[0]["rho"]
    assert all(lr.dtype == torch.float64 and lr.shape == (1,) for lr in lrs) and rho.dtype == torch.float64
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    train(model, opt, mlp_data(1))
    scheduler.step()
    state = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(state)
    assert [group["lr"] for group in opt.param_groups] == lrs and all(
        group["lr"] is lr and group["rho"] is rho for group, lr in zip(opt.param_groups, lrs)
    )
    assert lrs[0].item() == pytest.approx(BASES[base][1]["lr"] * 0.9, rel=1e-15)


@pytest.mark.parametrize("base", ["sgd", "adamw-amsgrad"])
def test_a_capturable_run_resumes_from_a_checkpoint_with_the_bits_of_the_default(base):
    """Two steps, a state dict saved, a new capturable optimizer loads it (step counts and momentum buffers onto the
    device), two more steps: as the default run of four."""
    batches = mlp_data(4)
    reference = build("gear-sam", base, "cpp", False)
    train(*reference, batches)
    model, opt = build("gear-sam", base, "cpp", True)
    train(model, opt, batches[:2])
    saved = copy.deepcopy(opt.state_dict())
    model_copy = copy.deepcopy(model)
    resumed = build("gear-sam", base, "cpp", True, model=model_copy)
    resumed[1].load_state_dict(saved)
    train(*resumed, batches[2:], start=2)
    assert_same_run(reference, resumed)


@pytest.mark.parametrize("backend,device", CPU_KERNELS)
@pytest.mark.parametrize("base", ["sgd", "adam"])
def test_a_capturable_step_reads_nothing_on_the_host(backend, device, base, monkeypatch):
    """After a first step (torch's warm-up before a capture), every way of reading a tensor's value on the host fails:
    the steps still run."""
    model, opt = build("gear-sam", base, backend, True)
    batches = mlp_data(3)
    train(model, opt, batches[:1])

    def host_read(*args, **kwargs):
        raise AssertionError("a capturable step read a tensor on the host")

    with monkeypatch.context() as patch:
        for method in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"):
            patch.setattr(torch.Tensor, method, host_read)
        for xy in batches[1:]:
            mse(model, xy).backward()
            opt.first_step(zero_grad=True)
            mse(model, xy).backward()
            opt.second_step(zero_grad=True)


@pytest.mark.parametrize("base", ["sgd", "adamw-amsgrad"])
def test_a_compiled_capturable_step_gives_the_eager_bits_and_does_not_recompile_for_a_new_lr(base):
    """torch.compile(fullgraph=True) over a capturable step: lr is a tensor, so a scheduler's every change reaches the
    compiled step without compiling it again (a float lr is a constant of the graph)."""
    torch._dynamo.reset()
    counters.clear()
    runs, graphs = [], []
    for compiled in (False, True):
        model, opt = build("gear-sam", base, "cpp", True)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
        first, second = opt.first_step, opt.second_step
        if compiled:
            first, second = torch.compile(first, fullgraph=True), torch.compile(second, fullgraph=True)
        for i, xy in enumerate(mlp_data(6)):
            if i == 3:
                graphs.append(counters["stats"]["unique_graphs"])
                opt.param_groups[0]["rho"].fill_(0.11)
            mse(model, xy).backward()
            first(zero_grad=True)
            mse(model, xy).backward()
            second(zero_grad=True)
            scheduler.step()
        runs.append((model, opt))
    assert_same_run(*runs)
    assert counters["stats"]["unique_graphs"] == graphs[1] > 0
    torch._dynamo.reset()


def test_telemetry_of_a_capturable_run_keeps_each_steps_rho():
    """BlockTelemetry buffers rows on the device and reads them later: the rho of each step, not the current one."""
    records = {}
    for capturable in (False, True):
        model, opt = build("gear-sam", "sgd", "cpp", capturable)
        telemetry = BlockTelemetry(opt, every=10)
        for i, xy in enumerate(mlp_data(4)):
            set_rho(opt, 0.01 * (i + 1))
            mse(model, xy).backward()
            opt.first_step(zero_grad=True)
            mse(model, xy).backward()
            opt.second_step(zero_grad=True)
            telemetry.record()
        records[capturable] = telemetry.flush()
    assert [r["rho"] for r in records[True]] == [0.01, 0.02, 0.03, 0.04]
    assert records[True] == records[False]


# ------------------------------------------------------------------------------------------- overflow on the device
def scaled_run(rule: str, base: str, capturable: bool, inject: dict[int, str]):
    """Four steps through SAMScaler; ``inject[i]`` ("first", "second", "both") writes inf into one gradient of that
    pass of step i. Returns the model, optimizer, scaler and the reports' (skipped, first finite, second finite
    where the first was, scale)."""
    model, opt = build(rule, base, "cpp", capturable)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    amp = SAMScaler(opt, scaler)
    assert amp.on_device is capturable
    reports = []
    for i, xy in enumerate(mlp_data(4)):
        for which in ("first", "second"):
            scaler.scale(mse(model, xy)).backward()
            if inject.get(i) in (which, "both"):
                model[0].weight.grad[1, 2] = float("inf")
            if which == "first" and not amp.first_step():
                break
        report = amp.second_step(zero_grad=True)
        # after a first-pass overflow the host path runs no second pass (reported finite), the device path does
        second = report.second_pass_finite if report.first_pass_finite else None
        reports.append((report.skipped, report.first_pass_finite, second, report.scale))
        scaler.update()
    return (model, opt), scaler, reports


@pytest.mark.parametrize("capturable", [False, True], ids=["host", "device"])
def test_cancel_step_puts_back_the_rho_of_the_step_before(capturable):
    """The step statistics after cancel_step() hold the completed step's rho, not the cancelled one's: a capturable
    step writes its rho into the device's tensor in place, whose value the cancellable step keeps."""
    model, opt = build("gear-sam", "sgd", "cpp", capturable)
    data = mlp_data(2)
    mse(model, data[0]).backward()
    opt.first_step(zero_grad=True)
    mse(model, data[0]).backward()
    opt.second_step(zero_grad=True)
    set_rho(opt, 0.3)
    mse(model, data[1]).backward()
    opt.first_step(zero_grad=True, cancellable=True)
    assert float(opt.step_statistics.rho) == 0.3
    opt.cancel_step()
    assert float(opt.step_statistics.rho) == opt.defaults["rho"] != 0.3


@pytest.mark.parametrize("rule", RULES)
# sgd-dampened: SGD reads its step count on the first momentum step only (no dampening there), so a count that a
# skipped step 0 advanced shows in step 1's momentum ("mixed")
@pytest.mark.parametrize("base", ["sgd", "sgd-dampened", "adam"])
@pytest.mark.parametrize("inject", [{}, {1: "first"}, {1: "second"}, {0: "both", 2: "first", 3: "second"}],
                         ids=["none", "first", "second", "mixed"])  # fmt: skip
def test_an_overflow_skipped_on_the_device_gives_the_bits_of_the_host_skip(rule, base, inject):
    """SAMScaler on the host (reads each pass's flag, cancels the step) and on the device (the kernels skip it):
    the same weights, state, step counts, EMA, loss scale and reports."""
    host, host_scaler, host_reports = scaled_run(rule, base, False, inject)
    device, device_scaler, device_reports = scaled_run(rule, base, True, inject)
    assert_same_run(host, device)
    assert host_scaler.get_scale() == device_scaler.get_scale()
    assert device_reports == host_reports
    assert [skipped for skipped, *_ in device_reports] == [i in inject for i in range(4)]


def test_a_first_pass_overflow_perturbs_nothing_and_keeps_the_ema():
    model, opt = build("gear-sam", "adam", "cpp", True)
    train(model, opt, mlp_data(1))
    ema = opt.step_statistics.ema.clone()
    before = [p.detach().clone() for p in model.parameters()]
    mse(model, mlp_data(1)[0]).backward()
    opt.first_step(zero_grad=True, found_inf=torch.ones((), dtype=torch.float32))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert torch.equal(opt.step_statistics.ema, ema) and not opt.step_statistics.radius.any()
    mse(model, mlp_data(1)[0]).backward()
    opt.second_step(zero_grad=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.state[model[0].weight]["step"].item() == 1


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(backend="torch"), "backend 'torch' has no capturable kernels"),
        (dict(backend="reference"), "backend 'reference' has no capturable kernels"),
        (dict(backend="cpp", base_step="per-tensor"), "base_step='per-tensor' was asked for"),
        (dict(backend="cpp", schedule=Every(2)), "decides on the host"),
    ],
)
def test_what_cannot_be_captured_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=f"capturable=True cannot be honoured: .*{words}"):
        SAM(mlp(), torch.optim.SGD, lr=0.1, capturable=True, **kwargs)


def test_an_optimizer_torch_does_not_fuse_is_refused():
    with pytest.raises(ValueError, match="capturable=True cannot be honoured: the base step must be fused.*RMSprop"):
        GEARSAM(mlp(), torch.optim.RMSprop, lr=0.1, backend="cpp", capturable=True)


def test_low_precision_parameters_are_refused():
    with pytest.raises(ValueError, match="takes float32 and float64 parameters, not \\['torch.bfloat16'\\]"):
        GEARSAM(mlp().bfloat16(), torch.optim.SGD, lr=0.1, backend="cpp", capturable=True)


def test_capturable_must_be_a_bool():
    with pytest.raises(TypeError, match="capturable must be a bool, got 1"):
        SAM(mlp(), torch.optim.SGD, lr=0.1, capturable=1)


@pytest.mark.parametrize("key", ["lr", "rho"])
def test_a_value_assigned_over_the_device_tensor_is_refused(key):
    model, opt = build("sam", "sgd", "cpp", True)
    opt.param_groups[0][key] = 0.5
    mse(model, mlp_data(1)[0]).backward()
    with pytest.raises(ValueError, match=f"param group 0's {key} was replaced .*group\\['{key}'\\].fill_"):
        opt.first_step()


def test_a_tensor_lr_that_requires_grad_is_refused():
    with pytest.raises(ValueError, match="param group 0: lr is a float32 tensor of shape \\(\\) on cpu that requires"):
        SAM(mlp(), torch.optim.SGD, lr=torch.tensor(0.1, requires_grad=True), backend="cpp", capturable=True)


def test_found_inf_needs_capturable_and_is_checked():
    model, opt = build("sam", "sgd", "cpp", False)
    mse(model, mlp_data(1)[0]).backward()
    with pytest.raises(ValueError, match="found_inf .* needs capturable=True"):
        opt.first_step(found_inf=torch.zeros(()))
    model, opt = build("sam", "sgd", "cpp", True)
    mse(model, mlp_data(1)[0]).backward()
    with pytest.raises(ValueError, match="found_inf must be torch.float32, got torch.float64"):
        opt.first_step(found_inf=torch.zeros((), dtype=torch.float64))


# ------------------------------------------------------------------------------------------- CUDA graphs
def resnet18_step(model, opt, x, y, amp=None):
    """One whole training step: both passes and the SAM step (frozen batch-norm statistics are not needed for
    identical replay: they are part of the graph too)."""
    loss_fn = nn.CrossEntropyLoss()
    with torch.autocast("cuda", dtype=torch.float16) if amp is not None else contextlib.nullcontext():
        loss = loss_fn(model(x), y)
    if amp is None:
        loss.backward()
        opt.first_step(zero_grad=True)
        loss_fn(model(x), y).backward()
        opt.second_step(zero_grad=True)
        return
    amp.scaler.scale(loss).backward()
    amp.first_step(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.float16):
        amp.scaler.scale(loss_fn(model(x), y)).backward()
    amp.second_step(zero_grad=True, set_to_none=False)


def _resnet18_pair(backend: str, rule: str):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).cuda()
    twin = copy.deepcopy(model)
    cls, rule_kwargs = RULES[rule]

    def make(m):
        lr = torch.tensor(0.05, device="cuda")
        return cls(m, torch.optim.SGD, backend=backend, capturable=True, lr=lr, momentum=0.9, weight_decay=5e-4,
                   **rule_kwargs)  # fmt: skip

    return (model, make(model)), (twin, make(twin))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cpp"])
@pytest.mark.parametrize("rule", RULES)
def test_a_resnet18_training_step_captured_in_a_cuda_graph_replays_as_eager(backend, rule):
    """Warm up three eager steps on a side stream (as torch's CUDA graph recipe does), capture one step, replay it
    on new batches with lr changed by a scheduler in between; the twin model takes the same steps eagerly. Eager and
    replayed kernels are the same, with set_to_none=False gradients in the flat buffers: equal within the float32
    bound of one step per step (cuDNN's algorithm may differ between capture and eager)."""
    (model, opt), (twin, twin_opt) = _resnet18_pair(backend, rule)
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [(torch.randn(8, 3, 32, 32, device="cuda", generator=gen), torch.randint(0, 10, (8,), device="cuda",
                generator=gen)) for _ in range(6)]  # fmt: skip
    static_x, static_y = (t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:3]:
            static_x.copy_(x), static_y.copy_(y)
            resnet18_step(model, opt, static_x, static_y)
            resnet18_step(twin, twin_opt, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        resnet18_step(model, opt, static_x, static_y)
    for step, (x, y) in enumerate(batches[3:]):
        if step == 1:
            for o in (opt, twin_opt):
                o.param_groups[0]["lr"].fill_(0.01)
        static_x.copy_(x), static_y.copy_(y)
        graph.replay()
        resnet18_step(twin, twin_opt, x, y)
    torch.cuda.synchronize()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_readme_cuda_graph_example_runs():
    """The README's block, as written, on the repository's ResNet-18: the replayed steps move the weights, and the
    scheduler's lr reached the graph (the weights after two replays differ from a run with the lr frozen)."""
    block, where = needs_block("# needs: a CUDA GPU")  # in the documentation's usage page
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    namespace = {"model": resnet18(width=4), "loader": [(x, y), (x, y)], "torch": torch, "F": F, "GEARSAM": GEARSAM}
    exec(compile(block, where, "exec"), namespace)
    torch.cuda.synchronize()
    assert namespace["opt"].base_step_mode == "fused"
    assert namespace["opt"].param_groups[0]["lr"].item() < 0.1  # the scheduler wrote into the tensor the graph reads
    assert all(torch.isfinite(p).all() for p in namespace["model"].parameters())
