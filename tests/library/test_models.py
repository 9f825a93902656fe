import pytest
import torch

from gearsam_fused.models import MODELS, ResNet, get_model

# Parameter counts of the full-size networks (10 classes for the CIFAR ones, 1000 for the ImageNet layouts).
FULL_SIZE = {
    "resnet18": (11_173_962, 62),
    "wrn28_10": (36_479_194, 80),
    "tv_resnet18": (11_689_512, 62),
    "efficientnet_b0": (5_288_548, 213),
    "vit_b16": (86_567_656, 152),
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_full_size_parameter_counts(name):
    with torch.device("meta"):
        model = get_model(name)
    params = list(model.parameters())
    assert (sum(p.numel() for p in params), len(params)) == FULL_SIZE[name]


def test_pyramidnet110_size():
    with torch.device("meta"):
        model = get_model("pyramidnet110")
    assert 27e6 < sum(p.numel() for p in model.parameters()) < 29e6  # the paper's PyramidNet-110 (alpha 270): 28.3M
    assert len(model.layer1) == len(model.layer2) == len(model.layer3) == 18
    assert model.fc.in_features == 16 + 270


@pytest.mark.parametrize(
    "name,kwargs,image",
    [
        ("resnet18", dict(width=4), 32),
        ("tv_resnet18", dict(width=4, num_classes=10), 64),
        ("wrn28_10", dict(depth=10, widen_factor=1), 32),
        ("pyramidnet110", dict(depth=20, alpha=12), 32),
        ("efficientnet_b0", dict(width_mult=0.25, depth_mult=0.5, num_classes=10), 64),
        ("vit_b16", dict(img_size=32, patch_size=8, dim=32, depth=2, heads=4, num_classes=10), 32),
        ("digits_resnet", dict(width=4, in_channels=3), 8),
    ],
)
def test_tiny_versions_run_forward_and_backward(name, kwargs, image):
    torch.manual_seed(0)
    model = get_model(name, **kwargs)
    out = model(torch.randn(2, 3, image, image))
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_digits_resnet_is_the_demos_network():
    torch.manual_seed(0)
    model = get_model("digits_resnet")
    torch.manual_seed(0)
    demo = ResNet(blocks=(1, 1, 1), width=16, num_classes=10, in_channels=1)  # what the demo has always trained
    assert list(model.state_dict()) == list(demo.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), demo.state_dict().values()))
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_unknown_model_and_bad_depth():
    with pytest.raises(ValueError, match="unknown model 'resnet9000'"):
        get_model("resnet9000")
    with pytest.raises(ValueError, match="6n\\+4"):
        get_model("wrn28_10", depth=27)
    with pytest.raises(ValueError, match="unknown activation"):
        get_model("resnet18", act="tanhh")
    assert set(MODELS) >= {"resnet18", "wrn28_10", "pyramidnet110"}
