"""Each private torch internal of ``gearsam_fused.compat`` against the installed torch: a release that changes one
fails here, by name."""

import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gearsam_fused import compat


def test_norm_bases_are_the_layers_with_running_statistics():
    batch = [nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.BatchNorm3d(3), nn.LazyBatchNorm2d(), nn.SyncBatchNorm(3)]
    instance = [nn.InstanceNorm1d(3), nn.InstanceNorm2d(3, track_running_stats=True), nn.InstanceNorm3d(3)]
    assert all(isinstance(m, compat.BatchNormBase) for m in batch)
    assert all(isinstance(m, compat.InstanceNormBase) and not isinstance(m, compat.BatchNormBase) for m in instance)
    assert not any(isinstance(m, (compat.BatchNormBase, compat.InstanceNormBase))
                   for m in (nn.LayerNorm(3), nn.GroupNorm(1, 3)))  # fmt: skip


def _scaled_sgd():
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale((w * torch.tensor([1.0, 2.0])).sum()).backward()
    return w, opt, scaler


def test_scaler_records_hold_each_optimizers_stage_and_overflows():
    w, opt, scaler = _scaled_sgd()
    records = compat.scaler_records(scaler)
    assert isinstance(records, dict) and id(opt) not in records
    assert compat.optimizer_record(scaler, opt)["stage"] is compat.OptState.READY  # made on first access
    scaler.unscale_(opt)
    record = compat.optimizer_record(scaler, opt)
    assert record["stage"] is compat.OptState.UNSCALED and torch.equal(w.grad, torch.tensor([1.0, 2.0]))
    assert {d: f.item() for d, f in record["found_inf_per_device"].items()} == {torch.device("cpu"): 0.0}
    scaler.step(opt)
    assert compat.optimizer_record(scaler, opt)["stage"] is compat.OptState.STEPPED
    compat.drop_optimizer_record(scaler, opt)
    assert id(opt) not in compat.scaler_records(scaler)
    assert compat.optimizer_record(scaler, opt)["stage"] is compat.OptState.READY  # a fresh record


def test_unscale_scales_in_place_and_flags_non_finite_gradients():
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    found_inf = torch.zeros(1)
    compat.unscale_(grads, found_inf, torch.tensor([0.5]))
    assert torch.equal(grads[0], torch.tensor([1.0, 2.0])) and found_inf.item() == 1.0


def _scheduler_warnings(step_first: bool) -> list[str]:
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    if step_first:
        compat.mark_stepped(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()
    return [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]


def test_mark_stepped_is_what_lr_schedulers_read():
    assert _scheduler_warnings(step_first=False)  # torch warns about a scheduler step before any optimizer step...
    assert not _scheduler_warnings(step_first=True)  # ...and reads the mark to know one happened


def test_step_hooks_are_torchs_in_torchs_order():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    calls = []

    def hook(name):
        return lambda *args: calls.append(name)

    handles = [
        register_optimizer_step_pre_hook(hook("global pre")),
        opt.register_step_pre_hook(hook("pre")),
        register_optimizer_step_post_hook(hook("global post")),
        opt.register_step_post_hook(hook("post")),
    ]
    try:
        opt.step()
        ours = []
        for h in [*compat.step_pre_hooks(opt), *compat.step_post_hooks(opt)]:
            h(opt, (), {})
            ours.append(calls[-1])
    finally:
        for handle in handles:
            handle.remove()
    assert calls[:4] == ["global pre", "pre", "post", "global post"] and ours == calls[:4]
    assert list(compat.step_pre_hooks(opt)) == [] and list(compat.step_post_hooks(opt)) == []


@pytest.mark.parametrize("fullgraph", [False, True])
def test_graph_may_break_reads_how_the_code_is_compiled(fullgraph):
    def f(x):
        return x + 1 if compat.graph_may_break() else x - 1

    x = torch.zeros(2)
    assert torch.equal(f(x), x - 1)  # eager: nothing to break
    torch._dynamo.reset()  # dynamo keeps compiled code per code object, across torch.compile's options
    compiled = torch.compile(f, backend="eager", fullgraph=fullgraph)
    assert torch.equal(compiled(x), x - 1 if fullgraph else x + 1)


def test_graph_break_splits_a_graph():
    def f(x):
        x = x + 1
        compat.graph_break()
        return x * 2

    explained = torch._dynamo.explain(f)(torch.zeros(2))
    assert explained.graph_break_count == 1 and explained.graph_count == 2


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_refusal_says_our_message_first_eagerly_and_inside_a_trace(fullgraph):
    def f(x):
        compat.raise_refusal(f"refused: {x.shape[0]} elements")
        return x

    with pytest.raises(RuntimeError, match=r"^refused: 2 elements$"):
        f(torch.zeros(2))
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"^refused: 2 elements($|\n)"):
        torch.compile(f, backend="eager", fullgraph=fullgraph)(torch.zeros(2))


def test_dtensor_is_torchs_public_one_where_torch_has_it():
    public = pytest.importorskip("torch.distributed.tensor")
    assert compat.DTensor is public.DTensor and compat.Shard is public.Shard
