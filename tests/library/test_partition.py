import pytest
import torch
from torch import nn

from gearsam_fused import Block, format_partition, partition
from gearsam_fused.models import MODELS, efficientnet_b0, pyramidnet110, resnet18, tv_resnet18, vit_b16, wrn28_10

TINY = {
    "resnet18": lambda: resnet18(width=4),
    "tv_resnet18": lambda: tv_resnet18(width=4),
    "resnet50": lambda: MODELS["resnet50"](width=4, blocks=(1, 1, 1, 1), num_classes=10),
    "wrn28_10": lambda: wrn28_10(depth=16, widen_factor=1),
    "pyramidnet110": lambda: pyramidnet110(depth=20, alpha=12),
    "efficientnet_b0": lambda: efficientnet_b0(width_mult=0.25, num_classes=10),
    "vit_b16": lambda: vit_b16(img_size=32, patch_size=8, dim=32, depth=3, heads=2, num_classes=10),
    "digits_resnet": lambda: MODELS["digits_resnet"](width=4),
}


def names(blocks):
    return [b.name for b in blocks]


def block_of(blocks, param_name):
    return next(b.name for b in blocks if param_name in b.param_names)


def test_tiny_table_covers_every_model():
    assert set(TINY) == set(MODELS)


@pytest.mark.parametrize("factory", [lambda: resnet18(width=4), lambda: tv_resnet18(width=4)])
def test_resnet18_coarse_is_the_paper_split(factory):
    blocks = partition(factory(), "coarse")
    assert names(blocks) == ["stem", "layer1", "layer2", "layer3", "layer4", "classifier"]
    assert blocks[0].param_names == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert blocks[-1].param_names == ["fc.weight", "fc.bias"]
    # a unit's normalisation parameters stay with its convolutions
    assert block_of(blocks, "layer2.0.shortcut.1.weight") == "layer2"


@pytest.mark.parametrize("name", ["wrn28_10", "pyramidnet110"])
def test_three_stage_nets_coarse(name):
    blocks = partition(TINY[name](), "coarse")
    assert names(blocks) == ["stem", "layer1", "layer2", "layer3", "classifier"]
    assert block_of(blocks, "fc.weight") == "classifier"


def test_fine_splits_stages_into_units():
    assert names(partition(resnet18(width=4), "fine")) == [
        "stem", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1", "layer4.0", "layer4.1",
        "classifier",
    ]  # fmt: skip
    assert names(partition(TINY["wrn28_10"](), "fine")) == [
        "stem", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1", "classifier",
    ]  # fmt: skip


def test_vit_coarse_keeps_tokens_with_the_embedding():
    blocks = partition(TINY["vit_b16"](), "coarse")
    assert names(blocks) == ["stem", "blocks.0", "blocks.1", "blocks.2", "classifier"]
    assert set(blocks[0].param_names) == {"cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"}
    assert set(blocks[-1].param_names) == {"norm.weight", "norm.bias", "head.weight", "head.bias"}
    assert "blocks.1.norm1.weight" in blocks[2].param_names
    # a transformer block is already a unit: fine leaves it whole
    assert names(partition(TINY["vit_b16"](), "fine")) == names(blocks)


def test_efficientnet_coarse_and_fine():
    model = TINY["efficientnet_b0"]()
    coarse = partition(model, "coarse")
    assert names(coarse) == ["stem"] + [f"features.{i}" for i in range(1, 8)] + ["classifier"]
    assert block_of(coarse, "features.8.1.weight") == "classifier"  # head conv's BN with the head
    fine = names(partition(model, "fine"))
    assert "features.2.0" in fine and "features.2.1" in fine and "features.1" in fine


@pytest.mark.parametrize("strategy", ["coarse", "fine", "tensor", "global"])
@pytest.mark.parametrize("model_name", sorted(TINY))
def test_every_trainable_parameter_in_exactly_one_block(model_name, strategy):
    model = TINY[model_name]()
    blocks = partition(model, strategy)
    ids = [id(p) for b in blocks for p in b.params]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    named = dict(model.named_parameters())
    for b in blocks:
        assert all(named[n] is p for n, p in zip(b.param_names, b.params))


def test_tensor_and_global():
    model = resnet18(width=4)
    tensor = partition(model, "tensor")
    assert names(tensor) == [n for n, _ in model.named_parameters()]
    (only,) = partition(model, "global")
    assert only.name == "global" and len(only.params) == 62


def test_frozen_parameters_are_left_out():
    model = resnet18(width=4)
    model.conv1.weight.requires_grad_(False)
    for strategy in ("coarse", "fine", "tensor", "global"):
        blocks = partition(model, strategy)
        assert all(p is not model.conv1.weight for b in blocks for p in b.params)
    assert partition(model, "coarse")[0].param_names == ["bn1.weight", "bn1.bias"]


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = resnet18(width=4)
        self.temperature = nn.Parameter(torch.ones(()))


def test_wrapper_is_opened_and_direct_parameter_joins_nearest_block():
    blocks = partition(Wrapper(), "coarse")
    assert names(blocks) == ["stem", "net.layer1", "net.layer2", "net.layer3", "net.layer4", "classifier"]
    assert blocks[0].param_names[0] == "temperature"


class ScaledStage(nn.Module):
    """A learned scale registered on the root, right before a stage: it joins the stage's block."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.layer1 = resnet18(width=4).layer1
        self.fc = nn.Linear(4, 2)


def test_fine_keeps_a_direct_parameter_that_joined_a_stage_with_its_first_unit():
    model = ScaledStage()
    assert [(b.name, b.param_names[0]) for b in partition(model, "coarse")] == [
        ("layer1", "scale"),
        ("classifier", "fc.weight"),
    ]
    blocks = partition(model, "fine")
    assert names(blocks) == ["layer1.0", "layer1.1", "classifier"]
    assert blocks[0].param_names == ["scale"] + [f"layer1.0.{n}" for n, _ in model.layer1[0].named_parameters()]


def wb(*modules):
    """The weight and bias names of the given module paths, in order."""
    return [f"{m}.{kind}" for m in modules for kind in ("weight", "bias")]


def blocks_of(model, strategy):
    """(name, parameter names) of each block, after checking every parameter is the model's under that name."""
    named = dict(model.named_parameters())
    blocks = partition(model, strategy)
    for b in blocks:
        assert all(named[n] is p for n, p in zip(b.param_names, b.params))
    return [(b.name, b.param_names) for b in blocks]


class PlainCNN(nn.Module):
    """A stem layer, two stages of plain layers and a head, as many CNNs are written; with ``norm``, BatchNorm after
    each convolution."""

    def __init__(self, norm=False):
        super().__init__()
        bn = (lambda c: [nn.BatchNorm2d(c)]) if norm else (lambda c: [])
        self.conv1 = nn.Conv2d(3, 4, 3)
        if norm:
            self.bn1 = nn.BatchNorm2d(4)
        self.layer1 = nn.Sequential(nn.Conv2d(4, 4, 3), *bn(4), nn.ReLU(), nn.Conv2d(4, 4, 3), *bn(4))
        self.layer2 = nn.Sequential(nn.Conv2d(4, 8, 3), *bn(8), nn.ReLU(), nn.Conv2d(8, 8, 3), *bn(8))
        self.fc = nn.Linear(8, 10)


class VGG(nn.Module):
    """torchvision's VGG layout: a flat ``features`` list, a pooling, a flat ``classifier`` list."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(), nn.Linear(16, 10))


class FCNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.norm1 = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 2)


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


class Holder(nn.Module):
    """A module holding the network, as a LightningModule or a task wrapper does."""

    def __init__(self, net):
        super().__init__()
        self.net = net


# (factory, coarse blocks, fine blocks or None when fine is coarse), blocks as (name, parameter names)
PLAIN = {
    "cnn": (
        PlainCNN,
        [("stem", wb("conv1")), ("layer1", wb("layer1.0", "layer1.2")), ("layer2", wb("layer2.0", "layer2.2")),
         ("classifier", wb("fc"))],
        [("stem", wb("conv1")), ("layer1.0", wb("layer1.0")), ("layer1.2", wb("layer1.2")),
         ("layer2.0", wb("layer2.0")), ("layer2.2", wb("layer2.2")), ("classifier", wb("fc"))],
    ),
    "cnn with batchnorm": (
        lambda: PlainCNN(norm=True),
        [("stem", wb("conv1", "bn1")), ("layer1", wb("layer1.0", "layer1.1", "layer1.3", "layer1.4")),
         ("layer2", wb("layer2.0", "layer2.1", "layer2.3", "layer2.4")), ("classifier", wb("fc"))],
        [("stem", wb("conv1", "bn1")), ("layer1.0+layer1.1", wb("layer1.0", "layer1.1")),
         ("layer1.3+layer1.4", wb("layer1.3", "layer1.4")), ("layer2.0+layer2.1", wb("layer2.0", "layer2.1")),
         ("layer2.3+layer2.4", wb("layer2.3", "layer2.4")), ("classifier", wb("fc"))],
    ),
    "vgg": (
        VGG,
        [("features", wb("features.0", "features.1", "features.4", "features.5")),
         ("classifier", wb("classifier.0", "classifier.3"))],
        [("features.0+features.1", wb("features.0", "features.1")),
         ("features.4+features.5", wb("features.4", "features.5")),
         ("classifier.0", wb("classifier.0")), ("classifier.3", wb("classifier.3"))],
    ),
    "mlp": (mlp, [("0", wb("0")), ("2", wb("2")), ("4", wb("4"))], None),
    "mlp with norms": (
        lambda: nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8),
                              nn.ReLU(), nn.Linear(8, 2)),
        [("0+1", wb("0", "1")), ("3+4", wb("3", "4")), ("6", wb("6"))],
        None,
    ),
    "mlp with input norm": (
        lambda: nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        [("0+1", wb("0", "1")), ("3", wb("3"))],
        None,
    ),
    "fc1 fc2 fc3": (FCNet, [("fc1+norm1", wb("fc1", "norm1")), ("fc2", wb("fc2")), ("fc3", wb("fc3"))], None),
    "held cnn": (
        lambda: Holder(PlainCNN()),
        [("stem", wb("net.conv1")), ("net.layer1", wb("net.layer1.0", "net.layer1.2")),
         ("net.layer2", wb("net.layer2.0", "net.layer2.2")), ("classifier", wb("net.fc"))],
        [("stem", wb("net.conv1")), ("net.layer1.0", wb("net.layer1.0")), ("net.layer1.2", wb("net.layer1.2")),
         ("net.layer2.0", wb("net.layer2.0")), ("net.layer2.2", wb("net.layer2.2")), ("classifier", wb("net.fc"))],
    ),
    "held mlp": (lambda: Holder(mlp()), [("net.0", wb("net.0")), ("net.2", wb("net.2")), ("net.4", wb("net.4"))], None),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_networks_get_their_stem_stages_and_head(name):
    factory, coarse, fine = PLAIN[name]
    assert blocks_of(factory(), "coarse") == coarse
    assert blocks_of(factory(), "fine") == (coarse if fine is None else fine)


@pytest.mark.parametrize("name", list(PLAIN))
@pytest.mark.parametrize("strategy", ["coarse", "fine"])
def test_frozen_plain_network_partition_is_the_full_partition_restricted(name, strategy):
    model = PLAIN[name][0]()
    full = partition(model, strategy)
    first = next(n for n, _ in model.named_parameters()).rsplit(".", 1)[0]  # the first layer, frozen
    freeze(model, all_but(first + "."))
    assert [(b.name, b.param_names) for b in partition(model, strategy)] == [
        (n, [k for k, _ in kept]) for n, kept in restricted(full)
    ]


def test_frozen_plain_cnn_keeps_its_blocks():
    model = freeze(PlainCNN(), all_but("layer1."))
    assert names(partition(model, "coarse")) == ["stem", "layer2", "classifier"]
    assert names(partition(model, "fine")) == ["stem", "layer2.0", "layer2.2", "classifier"]


@pytest.mark.parametrize(
    "factory",
    [lambda: nn.Linear(4, 2), lambda: nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)), lambda: Holder(nn.Linear(4, 2))],
    ids=["linear", "linear and its norm", "held linear"],
)
def test_a_single_parametered_unit_is_the_one_block_model(factory):
    model = factory()
    for strategy in ("coarse", "fine"):
        (block,) = partition(model, strategy)
        assert block.name == "model" and block.param_names == [n for n, _ in model.named_parameters()]


def trainable_only(prefixes):
    return lambda name: name.startswith(prefixes)


def all_but(prefixes):
    return lambda name: not name.startswith(prefixes)


RESNET_FREEZES = {
    "layer4+fc": trainable_only(("layer4.", "fc.")),
    "layer4.1+fc": trainable_only(("layer4.1.", "fc.")),
    "fc": trainable_only("fc."),
    "stem frozen": all_but(("conv1.", "bn1.")),
}
THREE_STAGE_FREEZES = {
    "layer3+head": trainable_only(("layer3.", "bn.", "fc.")),
    "layer3.1+head": trainable_only(("layer3.1.", "bn.", "fc.")),
    "fc": trainable_only("fc."),
    "stem frozen": all_but(("conv1.", "bn1.")),
}
FREEZES = {
    "resnet18": RESNET_FREEZES,
    "tv_resnet18": RESNET_FREEZES,
    "wrn28_10": THREE_STAGE_FREEZES,
    "pyramidnet110": THREE_STAGE_FREEZES,
    "efficientnet_b0": {
        "last stage+head": trainable_only(("features.7.", "features.8.", "classifier.")),
        "features.6.1+head": trainable_only(("features.6.1.", "features.8.", "classifier.")),
        "classifier": trainable_only("classifier."),
        "stem frozen": all_but("features.0."),
    },
    "vit_b16": {
        "last block+head": trainable_only(("blocks.2.", "norm.", "head.")),
        "middle block": trainable_only("blocks.1."),
        "head": trainable_only("head."),
        "stem frozen": all_but(("patch_embed.", "cls_token", "pos_embed")),
    },
}


def restricted(blocks):
    """The blocks cut down to their trainable parameters, empty ones dropped: (name, [(param name, param)])."""
    out = [(b.name, [(n, p) for n, p in zip(b.param_names, b.params) if p.requires_grad]) for b in blocks]
    return [(name, kept) for name, kept in out if kept]


def freeze(model, trainable):
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))
    return model


@pytest.mark.parametrize("strategy", ["coarse", "fine"])
@pytest.mark.parametrize(
    "model_name,pattern", [(m, f) for m in sorted(FREEZES) for f in FREEZES[m]], ids=lambda v: v.replace(" ", "_")
)
def test_frozen_model_partition_is_the_full_partition_restricted(model_name, pattern, strategy):
    model = TINY[model_name]()
    full = partition(model, strategy)
    freeze(model, FREEZES[model_name][pattern])
    expected = restricted(full)
    blocks = partition(model, strategy)
    assert names(blocks) == [name for name, _ in expected]
    for block, (_, kept) in zip(blocks, expected):
        assert block.param_names == [n for n, _ in kept]
        assert all(p is q for p, (_, q) in zip(block.params, kept))


@pytest.mark.parametrize(
    "pattern,coarse,fine",
    [
        ("layer4+fc", ["layer4", "classifier"], ["layer4.0", "layer4.1", "classifier"]),
        ("layer4.1+fc", ["layer4", "classifier"], ["layer4.1", "classifier"]),
        ("fc", ["classifier"], ["classifier"]),
        ("stem frozen", ["layer1", "layer2", "layer3", "layer4", "classifier"], None),
    ],
)
def test_frozen_resnet18_keeps_its_blocks(pattern, coarse, fine):
    model = freeze(resnet18(width=4), RESNET_FREEZES[pattern])
    assert names(partition(model, "coarse")) == coarse
    if fine is not None:
        assert names(partition(model, "fine")) == fine
    assert partition(model, "coarse")[-1].param_names == ["fc.weight", "fc.bias"]


class TinyLM(nn.Module):
    """Token and position embeddings, an ``nn.TransformerEncoder``, a final norm and an output head."""

    def __init__(self, layers):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(8, 16))
        self.embed = nn.Embedding(50, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50)


class GPTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.ln2 = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


class TinyGPT(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.wpe = nn.Embedding(8, 16)
        self.h = nn.ModuleList(GPTBlock() for _ in range(layers))
        self.ln_f = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 50, bias=False)


@pytest.mark.parametrize("strategy", ["coarse", "fine"])
@pytest.mark.parametrize("layers", [1, 2])
def test_transformer_encoder_lm_keeps_stem_layers_and_head_apart(layers, strategy):
    blocks = partition(TinyLM(layers), strategy)
    assert names(blocks) == ["stem"] + [f"encoder.layers.{i}" for i in range(layers)] + ["classifier"]
    assert blocks[0].param_names == ["pos", "embed.weight"]
    assert blocks[-1].param_names == ["norm.weight", "norm.bias", "head.weight", "head.bias"]


@pytest.mark.parametrize("strategy", ["coarse", "fine"])
def test_gpt_with_first_layer_frozen_keeps_stem_layer_and_head_apart(strategy):
    model = TinyGPT()
    full = partition(model, strategy)
    assert names(full) == ["stem", "h.0", "h.1", "classifier"]
    model.h[0].requires_grad_(False)
    blocks = partition(model, strategy)
    assert names(blocks) == ["stem", "h.1", "classifier"]
    assert blocks[0].param_names == ["wte.weight", "wpe.weight"]
    assert [(b.name, b.param_names) for b in blocks] == [(n, [k for k, _ in kept]) for n, kept in restricted(full)]


def test_lone_unit_is_not_opened_up():
    (layer,) = TinyGPT(layers=1).h
    model = nn.Sequential(nn.Linear(16, 16), layer, nn.Linear(16, 2))
    assert names(partition(model, "coarse")) == ["stem", "1", "classifier"]


def test_tied_weights_belong_to_their_first_owner():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.body = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4)))
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

    model = Tied()
    for strategy in ("coarse", "fine", "tensor", "global"):
        blocks = partition(model, strategy)
        owners = [b.name for b in blocks for p in b.params if p is model.embed.weight]
        assert len(owners) == 1


def test_a_tied_weight_is_named_by_its_first_alias_in_every_strategy():
    model = TinyGPT()
    model.lm_head.weight = model.wte.weight
    assert [n for n, p in model.named_parameters() if p is model.wte.weight] == ["wte.weight"]
    embeddings = [model.wte.weight, model.wpe.weight]
    rest = [p for n, p in model.named_parameters() if not n.startswith(("wte.", "wpe."))]
    strategies = ["coarse", "fine", "tensor", "global", {"embeddings": embeddings, "rest": rest}, lambda n, p: n[:2]]
    for strategy in strategies:
        blocks = partition(model, strategy)
        assert sorted(n for b in blocks for n in b.param_names) == sorted(n for n, _ in model.named_parameters())
        assert "wte.weight" in blocks[0].param_names, strategy
    assert names(partition(model, "tensor"))[0] == "wte.weight"
    assert partition(model, "global")[0].param_names[0] == "wte.weight"
    assert partition(model, strategies[4])[0].param_names == ["wte.weight", "wpe.weight"]


def test_callable_and_mapping_strategies():
    model = resnet18(width=4)
    blocks = partition(model, lambda name, p: "weights" if name.endswith("weight") else "biases")
    assert names(blocks) == ["weights", "biases"]
    mapping = {
        "head": list(model.fc.parameters()),
        "rest": [p for n, p in model.named_parameters() if not n.startswith("fc")],
    }
    blocks = partition(model, mapping)
    assert names(blocks) == ["head", "rest"] and blocks[0].param_names == ["fc.weight", "fc.bias"]


def test_bad_partitions_raise_clear_errors():
    model = resnet18(width=4)
    params = list(model.parameters())
    with pytest.raises(ValueError, match="unknown partition strategy 'blocky'"):
        partition(model, "blocky")
    with pytest.raises(ValueError, match="needs the model"):
        partition(None, "coarse", params=params)
    with pytest.raises(ValueError, match="two partition blocks"):
        partition(model, {"a": params[:3], "b": params[2:]})
    with pytest.raises(ValueError, match=r"trainable parameter fc\.bias is in no partition block"):
        partition(model, {"a": params[:-1]})
    with pytest.raises(ValueError, match="empty partition"):
        partition(model, {})
    with pytest.raises(ValueError, match="non-empty block name"):
        partition(model, lambda name, p: None)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="empty partition"):
        partition(frozen, "coarse")


def test_format_partition_lists_blocks_and_shares():
    text = format_partition(partition(resnet18(), "coarse"))
    lines = text.splitlines()
    assert lines[0].split() == ["block", "tensors", "params", "%"]
    assert lines[5].split()[:3] == ["layer4", "15", "8,393,728"]
    assert lines[-1].split() == ["total", "62", "11,173,962", "100.00"]


def test_block_repr_and_numel():
    b = Block("x", [nn.Parameter(torch.zeros(3, 4))], ["w"])
    assert b.numel == 12 and "numel=12" in repr(b)
