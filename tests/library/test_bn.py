"""frozen_bn_stats: the second forward pass normalises with batch statistics but leaves every running statistic as
the first pass left it, for every BatchNorm flavour, and every layer's settings come back even after an exception."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.bn import frozen_bn_stats

from conftest import ALL, SGD_KW, batches, loss_fn, tiny_resnet


class Net(nn.Module):
    """A small network around one BatchNorm layer of the given kind, fed inputs of the shape it expects."""

    SHAPES = {
        nn.BatchNorm1d: (8, 5),
        nn.BatchNorm2d: (8, 5, 3, 3),
        nn.BatchNorm3d: (8, 5, 2, 3, 3),
        nn.SyncBatchNorm: (8, 5, 3, 3),
    }

    def __init__(self, kind, momentum=0.1):
        super().__init__()
        self.shape = self.SHAPES[kind]
        self.lift = nn.Linear(self.shape[1], 5)
        self.norm = kind(5, momentum=momentum)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = self.lift(x.movedim(1, -1)).movedim(-1, 1)
        h = F.silu(self.norm(h))
        return self.head(h.flatten(2).mean(2) if h.dim() > 2 else h)

    def batch(self, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.shape, generator=g) * 3 + 1, torch.randint(0, 3, (self.shape[0],), generator=g)


def stats(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------- a full SAM step
@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_second_pass_leaves_running_stats_as_the_first_pass_left_them(backend, device, cls):
    model = tiny_resnet(device=device)
    opt = cls(model, torch.optim.SGD, rho=0.5, backend=backend, **SGD_KW)
    for step, xy in enumerate(batches(3, device=device)):
        first_pass_only = copy.deepcopy(model)
        loss_fn(first_pass_only, xy)
        expected = stats(first_pass_only)

        loss_fn(model, xy).backward()
        assert same(stats(model), expected)
        opt.first_step(zero_grad=True)
        with frozen_bn_stats(model) as frozen:
            assert len(frozen) == 6  # stem, two per residual unit, the projection shortcut
            loss_fn(model, xy).backward()
        opt.second_step(zero_grad=True)
        assert same(stats(model), expected)  # bit for bit, num_batches_tracked included
        assert expected["bn1.num_batches_tracked"].item() == step + 1

    # without it the second pass moves them (the test above has teeth)
    loss_fn(model, xy).backward()
    opt.first_step(zero_grad=True)
    before = stats(model)
    loss_fn(model, xy).backward()
    opt.second_step(zero_grad=True)
    assert not torch.equal(stats(model)["bn1.running_mean"], before["bn1.running_mean"])


@pytest.mark.parametrize("kind", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["ema", "cumulative"])
def test_every_batchnorm_kind_normalises_with_batch_stats_and_keeps_its_buffers(kind, momentum):
    """SyncBatchNorm runs here without a process group, where it takes the same local path as BatchNorm; the
    cross-process reduction itself needs several GPUs and is not exercised."""
    torch.manual_seed(0)
    model = Net(kind, momentum)
    opt = GEARSAM(model, torch.optim.SGD, partition="tensor", rho=0.5, lr=0.1)
    x, y = model.batch(0)
    F.cross_entropy(model(x), y).backward()
    expected = stats(model)
    opt.first_step(zero_grad=True)

    seen = {}

    def record(m, args, out):  # what the layer saw in the second pass, at the perturbed weights
        seen.update(
            input=args[0].detach(), output=out.detach(), weight=m.weight.detach().clone(), bias=m.bias.detach().clone()
        )

    model.norm.register_forward_hook(record)
    with frozen_bn_stats(model) as frozen:
        assert frozen == [model.norm] and model.training
        F.cross_entropy(model(x), y).backward()
    opt.second_step(zero_grad=True)
    assert same(stats(model), expected)

    # train mode, batch statistics: what batch_norm computes with no running buffers at all
    h, w, b, eps = seen["input"], seen["weight"], seen["bias"], model.norm.eps
    assert torch.equal(seen["output"], F.batch_norm(h, None, None, w, b, training=True, eps=eps))
    mean, var = expected["norm.running_mean"], expected["norm.running_var"]
    running = F.batch_norm(h, mean, var, w, b, training=False, eps=eps)
    assert (seen["output"] - running).abs().max() > 0.1  # so not the running statistics
    assert model.norm.track_running_stats and model.norm.momentum == momentum
    model(x)
    assert not same(stats(model), expected)  # and outside the block the layer tracks again


def test_settings_come_back_exactly_even_after_an_exception():
    model = nn.Sequential(
        nn.BatchNorm1d(4, momentum=0.3),
        nn.BatchNorm1d(4, momentum=None),
        nn.BatchNorm1d(4, track_running_stats=False),
        nn.BatchNorm1d(4),
    )
    model[3].eval()
    settings = [(m.track_running_stats, m.momentum, m.training) for m in model]
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(KeyError, match="inside"):
        with frozen_bn_stats(model) as frozen:
            assert frozen == [model[0], model[1], model[3]]  # the untracked layer has nothing to freeze
            assert not any(m.track_running_stats for m in model)
            model(torch.randn(6, 4))
            raise KeyError("inside")
    assert [(m.track_running_stats, m.momentum, m.training) for m in model] == settings
    assert same(model.state_dict(), buffers)


def test_nesting_and_eval_mode():
    model = tiny_resnet()
    with frozen_bn_stats(model):
        with frozen_bn_stats(model) as inner:
            assert inner == []  # already frozen: the inner block must not un-freeze on exit
        assert not model.bn1.track_running_stats
    assert model.bn1.track_running_stats
    model.eval()
    x = batches(1)[0][0]
    with frozen_bn_stats(model):
        out = model(x)
    assert torch.equal(out, model(x))  # eval mode keeps using the running statistics


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="expects an nn.Module, got list"):
        with frozen_bn_stats([nn.BatchNorm1d(3)]):
            pass
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.InstanceNorm2d(3, track_running_stats=True))
    with pytest.raises(ValueError, match=r"cannot freeze InstanceNorm2d '1'"):
        with frozen_bn_stats(model):
            pass
    model.eval()  # in eval mode it does not update its statistics, so there is nothing to refuse
    with frozen_bn_stats(model) as frozen:
        assert frozen == []
