"""A model's partition is the same through every wrapper a training framework puts around it or inside it: the same
blocks, holding the same parameter objects under the same names. Around it: ``torch.compile``, ``DataParallel``,
``DistributedDataParallel``, Lightning Fabric's module (alone, and around DDP), accelerate's ``prepare``; in place or
inside it: FSDP2's ``fully_shard``, compiled or activation-checkpointed submodules, accelerate's regional compilation.
The process-group cases run in one gloo process (127.0.0.1), as the DDP and FSDP2 tests do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gearsam_fused import partition
from gearsam_fused.models import resnet18

from ranks import run_ranks_once


def plain_cnn() -> nn.Module:
    """A stem layer, two stages of plain layers (``"coarse"`` finds them at level 2), a head."""
    stage = lambda c: nn.Sequential(nn.Conv2d(c, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))  # noqa: E731
    return nn.Sequential(nn.Conv2d(3, 4, 3), stage(4), stage(8), nn.Flatten(), nn.Linear(8, 10))


def mlp() -> nn.Module:
    """Layers only (``"coarse"`` makes each a block, at level 1)."""
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


class GPT(nn.Module):
    """Embedding, a list of transformer layers (what regional compilation compiles one by one), norm and head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.h = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50)


STRATEGIES = {"coarse": "coarse", "fine": "fine", "tensor": "tensor", "global": "global",
              "callable": lambda name, p: name.split(".")[0]}  # fmt: skip
MODELS = {"resnet18": lambda: resnet18(width=4), "plain cnn": plain_cnn, "mlp": mlp, "gpt": GPT}


def table(model: nn.Module, params: list[torch.Tensor]) -> dict:
    """Per strategy, each block's name, parameter names, and the positions of its parameters in ``params``."""
    position = {id(p): i for i, p in enumerate(params)}
    return {
        key: [(b.name, b.param_names, [position[id(p)] for p in b.params]) for b in partition(model, strategy)]
        for key, strategy in STRATEGIES.items()
    }


def each_child(wrapper):
    """Wraps every child of the root that holds parameters (a stage, a layer of an MLP, GPT's list of blocks)."""

    def wrap(model: nn.Module) -> nn.Module:
        for name, child in list(model.named_children()):
            if next(child.parameters(), None) is not None:
                setattr(model, name, wrapper(child))
        return model

    return wrap


def checkpointed(module: nn.Module) -> nn.Module:
    """torch.distributed's activation-checkpointing wrapper, as FSDP2 setups apply it to each layer."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(module)


def compiled_regions(model: nn.Module) -> nn.Module:
    from accelerate.utils import compile_regions

    return compile_regions(model, backend="eager")


def fabric_module(model: nn.Module) -> nn.Module:
    import lightning

    return lightning.Fabric(accelerator="cpu", devices=1).setup_module(model)


# Wrappers that need no process group; none of them runs the model (torch.compile compiles on the first call).
IN_PROCESS = {
    "torch.compile": torch.compile,
    "DataParallel": nn.DataParallel,
    "compiled children": each_child(torch.compile),
    "checkpointed children": each_child(checkpointed),
    "nested": lambda model: nn.DataParallel(torch.compile(each_child(checkpointed)(model))),
    "accelerate regional compilation": compiled_regions,
    "fabric module": fabric_module,
}
CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
NEEDS = {"checkpointed children": CHECKPOINT_WRAPPER, "nested": CHECKPOINT_WRAPPER,
         "accelerate regional compilation": "accelerate", "fabric module": "lightning"}  # fmt: skip


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("wrapper", list(IN_PROCESS))
def test_wrapped_model_has_the_bare_models_partition(wrapper, model_name):
    if wrapper in NEEDS:
        pytest.importorskip(NEEDS[wrapper])
    model = MODELS[model_name]()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    bare = table(model, params)
    wrapped = IN_PROCESS[wrapper](model)  # some wrap children in place: the bare table is taken first
    assert [n for n, _ in wrapped.named_parameters()] != names  # the wrapper shows in the module tree
    assert table(wrapped, params) == bare


# ------------------------------------------------------------------------------ under a process group
def _shard(model: nn.Module) -> nn.Module:
    """FSDP2 as the README shards: each child holding parameters on its own (each of GPT's layers rather than their
    list, which has no forward), then the root."""
    from torch.distributed.fsdp import fully_shard

    for module in [*getattr(model, "h", []), *model.children()]:
        if not isinstance(module, nn.ModuleList) and next(module.parameters(), None) is not None:
            fully_shard(module)
    return fully_shard(model)


def _under_process_group(rank: int) -> dict:
    """{wrapper: {model: (bare table, wrapped table, the wrapped model's own parameter names, None for FSDP2)}}; a
    wrapper whose package is not installed is left out."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrappers = {"DDP": DDP}
    try:
        import lightning

        fabric = lightning.Fabric(accelerator="cpu", devices=1, strategy="ddp")
        fabric.launch()  # one device: starts no process, takes the process group already there
        wrappers["fabric module around DDP"] = fabric.setup_module
    except ImportError:
        pass
    try:
        from accelerate import Accelerator
        from accelerate.utils import TorchDynamoPlugin

        plugin = TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
        wrappers["accelerate prepare"] = Accelerator(cpu=True, dynamo_plugin=plugin).prepare
    except ImportError:
        pass
    out: dict = {}
    for wrapper, wrap in wrappers.items():
        for model_name, factory in MODELS.items():
            model = factory()
            params = list(model.parameters())
            bare = table(model, params)
            wrapped = wrap(model)
            names = [n for n, _ in wrapped.named_parameters()]
            out.setdefault(wrapper, {})[model_name] = (bare, table(wrapped, params), names)
    for model_name, factory in MODELS.items():
        model = factory()
        bare = table(model, list(model.parameters()))
        _shard(model)  # in place: new (DTensor) parameters, the same structure and names
        sharded = list(model.parameters())
        assert all(type(p).__name__ == "DTensor" for p in sharded)
        out.setdefault("FSDP2", {})[model_name] = (bare, table(model, sharded), None)
    return out


def under_process_group() -> dict:
    """Rank 0's result of :func:`_under_process_group` on a one-process gloo group, computed on the first call; its
    failure fails every caller."""
    pytest.importorskip("torch.distributed.fsdp")
    return run_ranks_once(_under_process_group, world=1)[0]


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("wrapper", ["DDP", "FSDP2", "fabric module around DDP", "accelerate prepare"])
def test_distributed_model_has_the_bare_models_partition(wrapper, model_name):
    results = under_process_group()
    if wrapper not in results:
        pytest.skip(f"{wrapper}: its package is not installed")
    bare, wrapped, names = results[wrapper][model_name]
    if names is not None:  # the wrapper shows in the module tree (FSDP2 changes the parameters in place instead)
        assert names != [n for _, block_names, _ in bare["tensor"] for n in block_names]
    assert wrapped == bare
