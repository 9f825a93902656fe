"""Mixed precision: bf16 autocast as is, float16 loss scaling through SAMScaler (each pass unscaled once, an overflow
in either pass cancels the whole step without a trace and lowers the scale), low-precision parameters, and misuse."""

import copy

import pytest
import torch

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.amp import SAMScaler, ScaledStepReport, _can_unscale
from gearsam_fused.distributed import sam_step as distributed_sam_step

from conftest import ALL, FP32_STEP_RTOL, SGD_KW, batches, flat, loss_fn, rel_err, sam_step, tiny_resnet

# Weights in float32 with an autocast forward: the fused perturbations round like the reference's, so the bf16/fp16
# forward sees the same weights and the float32 step bound holds.
AUTOCAST_STEP_RTOL = FP32_STEP_RTOL
# Parameters stored in bf16/fp16: a single one-ulp disagreement in one element grows to ~3e-4 (bf16) and ~7e-5
# (fp16) within five steps of a low-precision model, so the whole-vector bound leaves 3x room for one such flip.
LOW_PRECISION_STEP_RTOL = {torch.bfloat16: 1e-3, torch.float16: 2e-4}


def scaled_step(amp, model, xy, *, autocast=None, inject=None, fill=float("inf")):
    """One step through SAMScaler; ``inject`` ("first", "second", "both") writes ``fill`` into one gradient of that
    pass after its scaled backward. Returns (first_step's result, report)."""

    device = next(model.parameters()).device.type

    def backward(which):
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            loss = loss_fn(model, xy)
        amp.scaler.scale(loss).backward()
        if inject in (which, "both"):
            model.layer1[0].conv2.weight.grad.view(-1)[3] = fill

    backward("first")
    perturbed = amp.first_step()
    backward("second")
    return perturbed, amp.second_step(zero_grad=True)


def base_state(opt) -> list[torch.Tensor]:
    return [s["momentum_buffer"].clone() for s in opt.base_optimizer.state.values()]


# ------------------------------------------------------------------------------------------ bf16 autocast
@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_bf16_autocast_needs_nothing_and_matches_reference(backend, device, cls, record_property):
    runs = {}
    for name, dtype in ((backend, torch.bfloat16), ("reference", torch.bfloat16), ("fp32", None)):
        model = tiny_resnet(device=device)
        opt = cls(model, torch.optim.SGD, rho=0.05, backend="reference" if name == "fp32" else name, **SGD_KW)
        trajectory = []
        for xy in batches(5, device=device):
            for which in ("first", "second"):
                with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                    out = model(xy[0])
                    loss = torch.nn.functional.cross_entropy(out, xy[1])
                assert out.dtype == (dtype or torch.float32)
                loss.backward()
                if which == "first":
                    opt.first_step(zero_grad=True)
            opt.second_step(zero_grad=True)
            trajectory.append(flat(model))
        assert all(p.dtype == torch.float32 for p in model.parameters())
        runs[name] = trajectory
    errors = [rel_err(ours, ref) for ours, ref in zip(runs[backend], runs["reference"])]
    record_property("max_step_rel_err", max(errors))  # in the JUnit XML: where AUTOCAST_STEP_RTOL comes from
    assert max(errors) <= AUTOCAST_STEP_RTOL, errors
    assert rel_err(runs["reference"][-1], runs["fp32"][-1]) > 1e-5  # the bf16 forward really ran (~1e-4 here)


# ------------------------------------------------------------------------------- float16 loss scaling
@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_scaled_steps_equal_unscaled_steps(backend, device, cls):
    """Power-of-two scales commute exactly with float rounding, so when each pass is unscaled exactly once and the
    energies see the unscaled gradients, the scaled run is the unscaled run bit for bit."""
    scaled_model, plain_model = tiny_resnet(device=device), tiny_resnet(device=device)
    scaled = cls(scaled_model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    plain = cls(plain_model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=2)
    amp = SAMScaler(scaled, scaler)
    scales = []
    for xy in batches(6, device=device):
        perturbed, report = scaled_step(amp, scaled_model, xy)
        scaler.update()
        sam_step(plain, plain_model, xy)
        assert perturbed and report == amp.last and not report.skipped and report.reason is None
        scales.append(report.scale)
        assert torch.equal(flat(scaled_model), flat(plain_model))
        assert torch.equal(scaled.block_stats()["energy"], plain.block_stats()["energy"])
    assert scales == [2.0**12, 2.0**12, 2.0**13, 2.0**13, 2.0**14, 2.0**14]  # the scale grew and never leaked in


def test_a_pass_the_caller_unscaled_is_not_unscaled_again():
    """Clipping needs unscaled gradients: scaler.unscale_ before either step is honoured, not repeated."""
    scaled_model, plain_model = tiny_resnet(), tiny_resnet()
    scaled = GEARSAM(scaled_model, torch.optim.SGD, rho=0.05, **SGD_KW)
    plain = GEARSAM(plain_model, torch.optim.SGD, rho=0.05, **SGD_KW)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    amp = SAMScaler(scaled, scaler)
    for xy in batches(4):
        for which in ("first", "second"):
            scaler.scale(loss_fn(scaled_model, xy)).backward()
            scaler.unscale_(scaled)
            torch.nn.utils.clip_grad_norm_(scaled_model.parameters(), max_norm=1e9)  # never clips: the test is exact
            amp.first_step() if which == "first" else amp.second_step(zero_grad=True)
        scaler.update()
        sam_step(plain, plain_model, xy)
        assert torch.equal(flat(scaled_model), flat(plain_model))


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
@pytest.mark.parametrize("inject,fill", [("first", float("inf")), ("second", float("nan")), ("both", float("inf"))])
def test_overflow_in_either_pass_cancels_the_step_without_a_trace(backend, device, cls, inject, fill):
    data = batches(6, device=device)
    model = tiny_resnet(device=device)
    twin = copy.deepcopy(model)
    opt = cls(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    twin_opt = cls(twin, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=1000)
    amp = SAMScaler(opt, scaler)
    for xy in data[:2]:  # momentum and EMA are non-trivial before the bad step
        scaled_step(amp, model, xy)
        scaler.update()
        sam_step(twin_opt, twin, xy)

    weights, momentum, stats = flat(model), base_state(opt), opt.block_stats()
    first_finite, second_finite = inject == "second", inject == "first"
    seen = {}

    def backward(which):
        scaler.scale(loss_fn(model, data[2])).backward()
        if inject in (which, "both"):
            model.layer1[0].conv2.weight.grad.view(-1)[3] = fill

    backward("first")
    assert amp.first_step() is first_finite
    seen["perturbed"] = not torch.equal(flat(model), weights)
    seen["ema_moved"] = not torch.equal(opt.block_stats()["score"], stats["score"])
    backward("second")
    report = amp.second_step(zero_grad=True)

    assert seen["perturbed"] is first_finite  # the first pass's inf never reaches the weights
    if cls is GEARSAM:
        assert seen["ema_moved"] is first_finite  # ... and a finite one moved the EMA, which must be rolled back
    reason = {"first": "first pass", "second": "second pass", "both": "first and second passes"}[inject]
    expected = ScaledStepReport(True, f"non-finite gradient in the {reason}", first_finite, second_finite, 2.0**10)
    assert report == expected
    assert amp.last is report
    assert torch.equal(flat(model), weights)
    assert all(torch.equal(a, b) for a, b in zip(base_state(opt), momentum))
    after = opt.block_stats()
    assert all(torch.equal(after[k], stats[k]) for k in stats)
    scaler.update()
    assert scaler.get_scale() == 2.0**9  # backed off exactly as after a step GradScaler.step skipped

    for xy in data[3:]:  # the skipped batch left nothing behind: the run continues as if it never came
        _, report = scaled_step(amp, model, xy)
        scaler.update()
        sam_step(twin_opt, twin, xy)
        assert not report.skipped
        assert rel_err(flat(model), flat(twin)) <= FP32_STEP_RTOL
    assert torch.equal(opt.block_stats()["score"], twin_opt.block_stats()["score"])


def test_the_second_pass_may_be_left_out_after_a_first_pass_overflow():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, **SGD_KW)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    amp = SAMScaler(opt, scaler)
    xy = batches(1)[0]
    before = flat(model)
    scaler.scale(loss_fn(model, xy)).backward()
    model.fc.bias.grad[0] = float("nan")
    assert amp.first_step() is False
    assert all(p.grad is None for p in model.parameters())  # zeroed for the second pass all the same
    report = amp.second_step()
    assert report.skipped and report.second_pass_finite and torch.equal(flat(model), before)
    scaler.update()
    assert scaler.get_scale() == 2.0**9


@pytest.mark.parametrize("backend,device", ALL)
def test_fp16_autocast_overflows_are_skipped_until_the_scale_fits(backend, device, record_property):
    """Real float16 overflow: a scale of 2**24 overflows the fp16 backward until update() has lowered it enough."""
    runs = {}
    for name in (backend, "reference"):
        model = tiny_resnet(device=device)
        opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=name, **SGD_KW)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**24, growth_interval=1000)
        amp = SAMScaler(opt, scaler)
        skipped, trajectory = [], []
        for xy in batches(16, device=device):
            _, report = scaled_step(amp, model, xy, autocast=torch.float16)
            scaler.update()
            skipped.append(report.skipped)
            trajectory.append(flat(model))
        runs[name] = skipped, trajectory, scaler.get_scale()
    skipped, trajectory, scale = runs[backend]
    assert skipped[:5] == [True] * 5  # nothing fits before update() has lowered the scale to 2**19
    assert skipped.count(False) >= 8  # and then most steps run
    assert scale == 2.0 ** (24 - skipped.count(True))
    assert skipped == runs["reference"][0]
    errors = [rel_err(ours, ref) for ours, ref in zip(trajectory, runs["reference"][1])]
    record_property("max_step_rel_err", max(errors))
    assert max(errors) <= AUTOCAST_STEP_RTOL, errors
    assert rel_err(trajectory[-1], flat(tiny_resnet(device=device))) > 1e-3  # the unskipped steps really moved


def test_a_disabled_scaler_makes_the_plain_step():
    a, b = tiny_resnet(), tiny_resnet()
    opt_a = GEARSAM(a, torch.optim.SGD, rho=0.05, **SGD_KW)
    opt_b = GEARSAM(b, torch.optim.SGD, rho=0.05, **SGD_KW)
    amp = SAMScaler(opt_a, torch.amp.GradScaler("cpu", enabled=False))
    for xy in batches(3):
        _, report = scaled_step(amp, a, xy)
        sam_step(opt_b, b, xy)
        assert report == ScaledStepReport(False, None, True, True, 1.0)
        assert torch.equal(flat(a), flat(b))


# ------------------------------------------------------------------------------- cancel_step itself
@pytest.mark.parametrize("backend,device", ALL)
def test_cancel_step_undoes_first_step_entirely(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    data = batches(3, device=device)
    sam_step(opt, model, data[0])
    weights, momentum, stats = flat(model), base_state(opt), opt.block_stats()
    loss_fn(model, data[1]).backward()
    opt.first_step(zero_grad=True, cancellable=True)
    assert not torch.equal(flat(model), weights) and not torch.equal(opt.block_stats()["score"], stats["score"])
    opt.cancel_step()
    assert torch.equal(flat(model), weights)
    assert all(torch.equal(a, b) for a, b in zip(base_state(opt), momentum))
    assert all(torch.equal(opt.block_stats()[k], v) for k, v in stats.items())
    sam_step(opt, model, data[2])  # and the optimizer carries on normally


def test_cancel_step_misuse():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, **SGD_KW)
    with pytest.raises(RuntimeError, match="without a preceding first_step"):
        opt.cancel_step()
    loss_fn(model, batches(1)[0]).backward()
    opt.first_step(zero_grad=True)
    with pytest.raises(RuntimeError, match=r"needs first_step\(cancellable=True\)"):
        opt.cancel_step()
    loss_fn(model, batches(1)[0]).backward()
    opt.second_step()  # the refused cancel left the step intact


class SecondPassFailed(Exception):
    pass


def _drive_step(driver, opt, model, xy, closure):
    if driver == "step":
        opt.zero_grad()
        loss_fn(model, xy).backward()
        opt.step(closure)
    elif driver == "sam_step":
        calls = []

        def twice():
            calls.append(None)
            return loss_fn(model, xy).backward() if len(calls) == 1 else closure()

        distributed_sam_step(opt, model, twice)
    else:
        opt.zero_grad()
        loss_fn(model, xy).backward()
        opt.first_step(zero_grad=True, cancellable=True)
        with opt.cancel_on_error():
            closure()
        opt.second_step()


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("driver", ["step", "sam_step", "cancel_on_error"])
@pytest.mark.parametrize("error", [SecondPassFailed, KeyboardInterrupt])
def test_an_exception_in_the_second_pass_cancels_the_step(backend, device, driver, error):
    """An out-of-memory error or an interrupt in the second pass must not leave w + eps in the model."""
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    data = batches(3, device=device)
    sam_step(opt, model, data[0])
    weights, momentum, stats = flat(model), base_state(opt), opt.block_stats()

    def failing():
        raise error("second pass")

    with pytest.raises(error, match="second pass"):
        _drive_step(driver, opt, model, data[1], failing)
    assert torch.equal(flat(model), weights)
    assert all(torch.equal(a, b) for a, b in zip(base_state(opt), momentum))
    assert all(torch.equal(opt.block_stats()[k], v) for k, v in stats.items())
    _drive_step(driver, opt, model, data[2], lambda: loss_fn(model, data[2]).backward())  # and it carries on
    assert not torch.equal(flat(model), weights)


def test_cancel_on_error_needs_a_cancellable_first_step():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, **SGD_KW)
    with pytest.raises(RuntimeError, match=r"after first_step\(cancellable=True\)"):
        with opt.cancel_on_error():
            pass
    loss_fn(model, batches(1)[0]).backward()
    opt.first_step(zero_grad=True)
    with pytest.raises(RuntimeError, match=r"after first_step\(cancellable=True\)"):
        with opt.cancel_on_error():
            pass
    loss_fn(model, batches(1)[0]).backward()
    opt.second_step()


# ------------------------------------------------------------------------------- low-precision parameters
@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_low_precision_parameters_match_reference(backend, device, dtype, cls, record_property):
    models = [tiny_resnet(dtype=dtype, device=device) for _ in range(2)]
    opts = [cls(m, torch.optim.SGD, rho=0.05, backend=b, **SGD_KW) for m, b in zip(models, (backend, "reference"))]
    eps = torch.finfo(dtype).eps
    errors = []
    for step, xy in enumerate(batches(5, dtype=dtype, device=device)):
        for m, o in zip(models, opts):
            sam_step(o, m, xy)
        if step == 0:  # one step: every element within one unit in the last place of the reference's
            for p, q in zip(*(m.parameters() for m in models)):
                torch.testing.assert_close(p, q, rtol=eps, atol=eps)
        errors.append(rel_err(flat(models[0]), flat(models[1])))
    record_property("max_step_rel_err", max(errors))
    assert max(errors) <= LOW_PRECISION_STEP_RTOL[dtype], errors
    assert all(p.dtype == dtype for p in models[0].parameters())
    assert rel_err(flat(models[0]), flat(tiny_resnet(dtype=dtype, device=device))) > 1e-3


@pytest.mark.parametrize("backend,device", ALL)
def test_bf16_parameters_through_the_scaler(backend, device):
    """GradScaler unscales bf16 gradients; bf16 has float32's exponent range, so scaling is exact there too."""
    scaled_model, plain_model = (tiny_resnet(dtype=torch.bfloat16, device=device) for _ in range(2))
    scaled = GEARSAM(scaled_model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    plain = GEARSAM(plain_model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**14)
    if not _grad_scaler_unscales_bf16(device):  # torch 2.11 on CUDA: refused up front, naming the parameter
        with pytest.raises(ValueError, match=r"parameter 'conv1.weight' is torch.bfloat16 on cuda:0, and this torch's "
                                             r"GradScaler cannot unscale torch.bfloat16 gradients there"):  # fmt: skip
            SAMScaler(scaled, scaler)
        return
    amp = SAMScaler(scaled, scaler)
    for xy in batches(4, dtype=torch.bfloat16, device=device):
        _, report = scaled_step(amp, scaled_model, xy)
        scaler.update()
        sam_step(plain, plain_model, xy)
        assert not report.skipped
        tol = 0.0 if device == "cpu" else LOW_PRECISION_STEP_RTOL[torch.bfloat16]
        assert rel_err(flat(scaled_model), flat(plain_model)) <= tol


def test_parameters_whose_gradients_torch_cannot_unscale_are_refused_up_front(monkeypatch):
    """torch 2.11 has no CUDA unscale kernel for bfloat16 gradients; SAMScaler finds out at construction, not in the
    middle of a step. Simulated on CPU by taking bfloat16 away from torch's unscale operation."""
    unscale = torch._amp_foreach_non_finite_check_and_unscale_

    def without_bf16(grads, found_inf, inv_scale):
        if grads[0].dtype == torch.bfloat16:
            raise NotImplementedError(
                "\"_amp_foreach_non_finite_check_and_unscale_cpu\" not implemented for 'BFloat16'"
            )
        return unscale(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", without_bf16)
    _can_unscale.cache_clear()  # the answer is cached per (dtype, device)
    try:
        half = GEARSAM(tiny_resnet(dtype=torch.bfloat16), torch.optim.SGD, lr=0.1)
        with pytest.raises(ValueError, match=r"parameter 'conv1.weight' is torch.bfloat16 on cpu, and this torch's "
                                             r"GradScaler cannot unscale torch.bfloat16 gradients there; bfloat16 has "
                                             r"float32's exponent range and needs no loss scaling"):  # fmt: skip
            SAMScaler(half, torch.amp.GradScaler("cpu"))
        SAMScaler(half, torch.amp.GradScaler("cpu", enabled=False))  # a disabled scaler unscales nothing
        SAMScaler(GEARSAM(tiny_resnet(), torch.optim.SGD, lr=0.1), torch.amp.GradScaler("cpu"))  # float32 is fine
    finally:
        _can_unscale.cache_clear()


def _grad_scaler_unscales_bf16(device: str) -> bool:
    """Whether torch's own GradScaler.unscale_ takes bfloat16 gradients on ``device``."""
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16, device=device))
    p.grad = torch.ones_like(p)
    scaler = torch.amp.GradScaler(device)
    scaler.scale(p.sum())  # sets up the scale
    try:
        scaler.unscale_(torch.optim.SGD([p], lr=0.1))
    except NotImplementedError:
        return False
    return True


# ------------------------------------------------------------------------------------------ misuse
def test_misuse_raises_clear_errors():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, **SGD_KW)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(TypeError, match="optimizer must be a gearsam_fused SAM or GEARSAM, got SGD"):
        SAMScaler(torch.optim.SGD(model.parameters(), lr=0.1), scaler)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler, got str"):
        SAMScaler(opt, "cpu")
    half = tiny_resnet(dtype=torch.float16)
    with pytest.raises(ValueError, match="parameter 'conv1.weight' is float16"):
        SAMScaler(GEARSAM(half, torch.optim.SGD, lr=0.1), scaler)

    amp = SAMScaler(opt, scaler)
    with pytest.raises(RuntimeError, match=r"second_step\(\) called without a preceding first_step"):
        amp.second_step()
    scaler.scale(loss_fn(model, batches(1)[0]))  # initialises the scale; no backward
    with pytest.raises(RuntimeError, match="found no gradients"):
        amp.first_step()
    xy = batches(1)[0]
    scaler.scale(loss_fn(model, xy)).backward()
    amp.first_step()
    with pytest.raises(RuntimeError, match=r"first_step\(\) called twice"):
        amp.first_step()
    with pytest.raises(RuntimeError, match="found no gradients: call scaler.scale"):
        amp.second_step()
    scaler.scale(loss_fn(model, xy)).backward()
    amp.second_step(zero_grad=True)
    scaler.scale(loss_fn(model, xy)).backward()
    with pytest.raises(RuntimeError, match=r"call scaler.update\(\) once at the end of every step"):
        amp.first_step()  # the previous step was not followed by scaler.update()
    scaler.update()
    with pytest.raises(RuntimeError, match="needs a closure"):
        scaler.step(opt)  # GradScaler's own one-pass recipe refuses a SAM optimizer loudly
