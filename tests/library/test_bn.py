"""frozen_bn_stats: the second forward pass normalises with batch statistics but leaves every running statistic as
the first pass left it, for every BatchNorm flavour, and every layer's settings come back even after an exception.
recompute_bn_stats: the running statistics become the cumulative average of the batches' statistics computed by hand,
at the weights in the model (MomentumSAM's w after eval()), with every setting restored."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gearsam_fused import GEARSAM, SAM, MomentumSAM, recompute_bn_stats
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


# ----------------------------------------------------------------------------------- recompute_bn_stats
class Stack(nn.Module):
    """Conv -> BatchNorm2d -> pool -> dropout -> Linear -> BatchNorm1d, and a BatchNorm1d that tracks nothing; the
    input of each tracking layer can be computed by hand."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn2d = nn.BatchNorm2d(4, momentum=0.3)
        self.drop = nn.Dropout(0.5)
        self.lin = nn.Linear(4, 5)
        self.bn1d = nn.BatchNorm1d(5, momentum=None)
        self.untracked = nn.BatchNorm1d(5, track_running_stats=False)
        with torch.no_grad():
            for bn in (self.bn2d, self.bn1d):  # affine parameters away from 1 and 0, so that they matter
                bn.weight.uniform_(0.5, 2.0)
                bn.bias.uniform_(-1.0, 1.0)

    def forward(self, x):
        h = F.relu(self.bn2d(self.conv(x))).mean((2, 3))
        return self.untracked(self.bn1d(self.lin(self.drop(h))))

    def inputs_of_the_tracking_layers(self, x):
        """What bn2d and bn1d see in a train-mode pass of the layers with dropout off."""
        with torch.no_grad():
            h2d = self.conv(x)
            normed = F.batch_norm(h2d, None, None, self.bn2d.weight, self.bn2d.bias, training=True, eps=self.bn2d.eps)
            return h2d, self.lin(F.relu(normed).mean((2, 3)))


def image_batches(sizes=(6, 3, 9)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, 3, 4, 4, generator=g) * 2 + 1, torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def cumulative(model: Stack, data) -> dict[str, torch.Tensor]:
    """By hand: per channel, the average over the batches of each batch's mean and unbiased variance."""
    seen = [model.inputs_of_the_tracking_layers(x) for x, _ in data]
    out = {}
    for name, dims, k in (("bn2d", (0, 2, 3), 0), ("bn1d", (0,), 1)):
        out[f"{name}.running_mean"] = torch.stack([s[k].mean(dims) for s in seen]).mean(0)
        out[f"{name}.running_var"] = torch.stack([s[k].var(dims, unbiased=True) for s in seen]).mean(0)
    return out


def settings(model: nn.Module) -> list:
    return [(m.training, getattr(m, "momentum", None)) for m in model.modules()]


def test_recompute_bn_stats_is_the_cumulative_average_of_each_batchs_statistics():
    """Every tracking layer ends with the average over the batches of each batch's mean and unbiased variance (batches
    of different sizes count alike), its counter at the number of batches; gathered with the BatchNorm layers in train
    mode and dropout off; the parameters, each layer's momentum and every module's mode as before."""
    model = Stack()
    data = image_batches()
    for x, _ in image_batches((8, 8)):
        model(x)  # stale statistics, which must not leak into the new ones
    model.bn2d.eval()  # mixed modes, restored as they were
    before = settings(model)
    params = {k: v.clone() for k, v in model.named_parameters()}

    assert recompute_bn_stats(model, data) == 3
    want = cumulative(model, data)
    got = stats(model)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    assert got["bn2d.num_batches_tracked"].item() == got["bn1d.num_batches_tracked"].item() == 3
    assert settings(model) == before and model.training and not model.bn2d.training
    assert all(torch.equal(p, params[k]) and p.grad is None for k, p in model.named_parameters())

    # what plain train-mode passes leave (each layer's own momentum, dropout on) is something else: the check has teeth
    plain = Stack()
    plain.train()
    for x, _ in data:
        plain(x)
    assert not torch.allclose(stats(plain)["bn2d.running_mean"], want["bn2d.running_mean"], rtol=1e-3, atol=1e-3)


def test_recompute_bn_stats_takes_tuples_tensors_and_mappings_and_stops_at_max_batches():
    model, data = Stack(), image_batches()
    recompute_bn_stats(model, data)
    from_tuples = stats(model)
    recompute_bn_stats(model, [x for x, _ in data])
    assert same(stats(model), from_tuples)

    class Keywords(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, pixel_values, labels=None):
            return self.net(pixel_values)

    recompute_bn_stats(Keywords(model), [{"pixel_values": x, "labels": y} for x, y in data])
    assert same(stats(model), from_tuples)

    drawn = []

    def loader():
        for xy in data:
            drawn.append(xy)
            yield xy

    assert recompute_bn_stats(model, loader(), max_batches=2) == 2
    assert len(drawn) == 2  # no batch drawn that is not used
    for key, value in cumulative(model, data[:2]).items():
        torch.testing.assert_close(stats(model)[key], value, rtol=1e-5, atol=1e-6)


def test_recompute_bn_stats_at_momentum_sams_weights():
    """The use it is for: after opt.eval() the statistics are recomputed at w (not at the look-ahead point the training
    passes ran at); opt.train() then moves the parameters back to the look-ahead point and leaves the statistics."""
    model, data = Stack(), image_batches()
    opt = MomentumSAM(model, torch.optim.SGD, rho=0.5, lr=0.1, momentum=0.9)
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    lookahead = [p.clone() for p in model.parameters()]
    at_lookahead = cumulative(model, data)
    opt.eval()
    recompute_bn_stats(model, data)
    recomputed = stats(model)
    for key, value in cumulative(model, data).items():  # the inputs by hand at the weights in the model: w
        torch.testing.assert_close(recomputed[key], value, rtol=1e-5, atol=1e-6)
    opt.train()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), lookahead, strict=True))
    assert same(stats(model), recomputed)
    assert not torch.allclose(recomputed["bn1d.running_mean"], at_lookahead["bn1d.running_mean"], atol=1e-3)


def test_recompute_bn_stats_refuses_what_it_cannot_do_and_restores_settings_after_an_error():
    with pytest.raises(TypeError, match="expects an nn.Module, got list"):
        recompute_bn_stats([nn.BatchNorm1d(3)], [torch.randn(4, 3)])
    with pytest.raises(ValueError, match="Sequential has no BatchNorm layer that tracks running statistics"):
        recompute_bn_stats(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, track_running_stats=False)),
                           [torch.randn(4, 3)])  # fmt: skip
    model = Stack()
    model(image_batches()[0][0])
    kept = stats(model)
    with pytest.raises(ValueError, match="needs at least one batch"):
        recompute_bn_stats(model, iter([]))
    assert same(stats(model), kept)  # refused before anything was reset
    with pytest.raises(ValueError, match="max_batches must be a positive integer"):
        recompute_bn_stats(model, image_batches(), max_batches=0)

    model.eval()
    before = settings(model)

    def failing():
        yield image_batches()[0]
        raise KeyError("loader")

    with pytest.raises(KeyError, match="loader"):
        recompute_bn_stats(model, failing())
    assert settings(model) == before and not model.training
