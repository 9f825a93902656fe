"""FSDP2 (``fully_shard``): SAM, ASAM and GEAR-SAM on a model sharded over 2 and 4 gloo processes (127.0.0.1).

Every rank trains on its slice of a global batch. The expected results come from one process running the same
optimizer on the whole batch: FSDP2 averages the ranks' gradients, which equals the whole batch's mean gradient up to
the order of the sums, so trajectories agree within the suite's per-step float32 tolerance. With bfloat16 mixed
precision each rank's gradient is a bfloat16 value, whose float32 average over the ranks comes out the same in any
order for these gradients, and the run equals the same computation in one process bit for bit. Every rank must hold
bitwise the same (gathered) parameters, GEAR EMA and radii: the block energies are summed over the ranks by one
all-reduce, the same bits everywhere.

The model has a parameter whose rows do not divide among the ranks (one rank of four holds none of ``head``), a frozen
layer, and a layer used only on even steps (no gradient on the others). Each world size runs once, in one set of
processes, and every test reads its part of the results.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gearsam_fused import GEARSAM, SAM, FriendlyAscent, SurrogateGap, WeightedSharpness
from gearsam_fused.distributed import sam_step
from gearsam_fused.models import resnet18

from conftest import FP32_STEP_RTOL, rel_err
from doc_blocks import needs_block
from ranks import run_ranks, run_ranks_once, selected_values

pytest.importorskip("torch.distributed.fsdp")
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

WORLDS = (4, 2)  # 4 first: the one case of each test the default tier runs splits the layers unevenly
PER_RANK = 2  # samples per rank and step
STEPS = 10
SEED = 3
SGD = dict(lr=0.1, momentum=0.9, weight_decay=5e-4)


class Unit(nn.Module):
    """A residual unit of two layers; in a stage (``nn.Sequential(Unit())``) the structure that "coarse" partitioning
    makes a block of its own."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10)
        self.fc2 = nn.Linear(10, 10)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(h)))


class Net(nn.Module):
    """BatchNorm-free. ``stem`` has 10 rows (uneven over 4 ranks), ``head`` 3 (one rank of 4 holds none), ``frozen``
    takes no gradient and ``extra`` is used on even steps only."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 10)
        self.stage = nn.Sequential(Unit())
        self.frozen = nn.Sequential(Unit())
        self.extra = nn.Sequential(Unit())
        self.head = nn.Linear(10, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.frozen(self.stage(torch.tanh(self.stem(x))))
        return self.head(self.extra(h) if step % 2 == 0 else h)


def make_net() -> Net:
    torch.manual_seed(SEED)
    return Net()


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    n = world * PER_RANK
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(STEPS)]


class Scenario(NamedTuple):
    method: str  # "sam", "asam", "gear-sam", or one of FAMILY
    backend: str
    driver: str = "two-pass"  # or "closure": opt.step(closure); or gearsam_fused.distributed.sam_step
    reshard_after_forward: bool = True
    mixed_precision: bool = False


SCENARIOS = {
    "sam": Scenario("sam", "auto"),
    "asam": Scenario("asam", "auto", reshard_after_forward=False),
    "gear-sam": Scenario("gear-sam", "auto"),
    "gear-sam-reference": Scenario("gear-sam", "reference", reshard_after_forward=False),
    "sam-closure": Scenario("sam", "auto", driver="closure"),
    "gear-sam-sam_step": Scenario("gear-sam", "auto", driver="sam_step"),
    "gear-sam-bf16": Scenario("gear-sam", "auto", mixed_precision=True),
    **{method: Scenario(method, "auto") for method in ("gsam", "gear-gsam", "wsam", "friendly-sam")},
}


#: The SAM family's scenarios: method -> the parts (gearsam_fused.family), on SAM's allocation or GEAR-SAM's.
FAMILY = {
    "gsam": dict(descent=SurrogateGap(0.3)),
    "gear-gsam": dict(descent=SurrogateGap(0.3)),
    "wsam": dict(descent=WeightedSharpness(0.8)),
    "friendly-sam": dict(ascent=FriendlyAscent()),
}


def make_optimizer(model: nn.Module, scenario: Scenario):
    parts = FAMILY.get(scenario.method, {})
    if scenario.method.startswith("gear-"):
        return GEARSAM(model, torch.optim.SGD, partition="coarse", rho=0.05, beta=0.9, backend=scenario.backend,
                       **parts, **SGD)  # fmt: skip
    if parts:
        return SAM(model, torch.optim.SGD, rho=0.05, backend=scenario.backend, **parts, **SGD)
    adaptive = scenario.method == "asam"
    return SAM(
        model, torch.optim.SGD, rho=0.5 if adaptive else 0.05, adaptive=adaptive, backend=scenario.backend, **SGD
    )


def train(model: nn.Module, opt, data, driver: str = "two-pass", start: int = 0) -> list[torch.Tensor]:
    """The steps over ``data`` (the first numbered ``start``); after each, the parameters (gathered whole on every
    rank when sharded)."""
    trajectory = []
    for step, (x, y) in enumerate(data, start):

        def loss():
            return F.cross_entropy(model(x, step), y)

        loss().backward()
        if driver == "closure":
            opt.step(lambda: loss().backward())
            opt.zero_grad()
        elif driver == "sam_step":
            opt.zero_grad()
            sam_step(opt, model, lambda: loss().backward())
            opt.zero_grad()
        else:
            opt.first_step(zero_grad=True)
            loss().backward()
            opt.second_step(zero_grad=True)
        trajectory.append(torch.cat([whole(p).reshape(-1) for p in model.parameters()]))
    return trajectory


def whole(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()


def shard(net: Net, scenario: Scenario) -> Net:
    """``net`` sharded over every rank, on the device its parameters are on (fully_shard's default mesh would be a
    CUDA one wherever a GPU is visible, also for the gloo tests)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh(next(net.parameters()).device.type, (dist.get_world_size(),))
    kwargs = dict(reshard_after_forward=scenario.reshard_after_forward, mesh=mesh)
    if scenario.mixed_precision:
        kwargs["mp_policy"] = policy
    for layer in (net.stem, net.stage, net.frozen, net.extra, net.head):
        fully_shard(layer, **kwargs)
    fully_shard(net, **kwargs)
    return net


def rank_data(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK])
            for x, y in batches(world)]  # fmt: skip


def _on_every_rank(rank: int, world: int, names: tuple[str, ...]) -> dict:
    data = rank_data(rank, world)
    out = {}
    for name in names:
        scenario = SCENARIOS[name]
        model = shard(make_net(), scenario)
        opt = make_optimizer(model, scenario)
        trajectory = train(model, opt, data, scenario.driver)
        state = opt.state_dict()["param_groups"][0]["gearsam"]
        out[name] = {
            "w": trajectory, "ema": state["ema"], "radius": state["radius"], "blocks": opt.block_names,
            "backend": opt.backend_name,
        }  # fmt: skip
    out["refused"] = {}
    model = shard(make_net(), SCENARIOS["sam"])
    try:
        sam_step(make_optimizer(model, SCENARIOS["sam"]), model, lambda: None, m_sharpness=True)
    except ValueError as error:
        out["refused"]["m_sharpness"] = str(error)
    for backend in ("torch", "cpp"):
        try:
            SAM(shard(make_net(), SCENARIOS["sam"]), torch.optim.SGD, lr=0.1, backend=backend)
        except ValueError as error:
            out["refused"][backend] = str(error)
    return out


def everything(request, world: int) -> list[dict]:
    """Every rank's results for ``world`` ranks, computed on the first call; its failure fails every caller. The
    scenarios: those the run's selected cases name, and the two the bf16 comparison and the blocks' check read."""
    names = selected_values(request, "name") | {"gear-sam", "gear-sam-bf16"}
    return run_ranks_once(_on_every_rank, world, tuple(n for n in SCENARIOS if n in names), world=world)


def single_process(name: str, world: int) -> dict:
    scenario = SCENARIOS[name]
    model = make_net()
    opt = make_optimizer(model, scenario._replace(backend="reference"))
    trajectory = train(model, opt, batches(world), scenario.driver)
    state = opt.state_dict()["param_groups"][0]["gearsam"]
    return {"w": trajectory, "ema": state["ema"], "radius": state["radius"], "blocks": opt.block_names}


EXACT = [name for name, s in SCENARIOS.items() if not s.mixed_precision]


@pytest.mark.heavy  # processes: the default tier's one case runs on 4 ranks
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", EXACT)
def test_trajectory_equals_one_process_on_the_whole_batch(request, name, world):
    ranks = everything(request, world)
    want = single_process(name, world)
    for step in range(STEPS):
        err = rel_err(ranks[0][name]["w"][step].double(), want["w"][step].double())
        assert err <= FP32_STEP_RTOL, f"step {step}: relative error {err:.3g}"
    torch.testing.assert_close(ranks[0][name]["ema"], want["ema"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ranks[0][name]["radius"], want["radius"], rtol=1e-5, atol=0)


@pytest.mark.heavy  # processes: the default tier's one case runs on 4 ranks
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_holds_the_same_bits(request, name, world):
    ranks = everything(request, world)
    first = ranks[0][name]
    assert all(torch.isfinite(w).all() for w in first["w"])
    for other in ranks[1:]:
        for step in range(STEPS):
            assert torch.equal(other[name]["w"][step], first["w"][step]), step
        assert torch.equal(other[name]["ema"], first["ema"]) and torch.equal(other[name]["radius"], first["radius"])


def single_process_bf16(world: int, bf16=(True, True)) -> dict:
    """What the ranks compute under ``param_dtype=bfloat16, reduce_dtype=float32``, in one process: each rank's
    forward and backward on a bfloat16 copy of the float32 weights and on its slice of the batch (inputs cast to
    bfloat16, as FSDP2 casts them), the gradients cast to float32 and averaged over the ranks, then the same
    optimizer step (reference backend) on the float32 weights. ``bf16``: whether the first and the second pass run in
    bfloat16 (a pass in float32 is the mistake the comparison must catch)."""
    model = make_net()
    opt = make_optimizer(model, SCENARIOS["gear-sam-bf16"]._replace(backend="reference"))
    trajectory = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        for step, (x, y) in enumerate(batches(world)):

            def averaged_gradient(in_bf16: bool):
                total = [None] * len(list(model.parameters()))
                for rank in range(world):
                    xs, ys = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
                    replica = copy.deepcopy(model)
                    if in_bf16:
                        replica, xs = replica.to(torch.bfloat16), xs.to(torch.bfloat16)
                    F.cross_entropy(replica(xs, step), ys).backward()
                    for i, q in enumerate(replica.parameters()):
                        if q.grad is not None:
                            g = q.grad.float() / world
                            total[i] = g if total[i] is None else total[i] + g
                for p, g in zip(model.parameters(), total):
                    p.grad = g

            averaged_gradient(bf16[0])
            opt.first_step(zero_grad=True)
            averaged_gradient(bf16[1])
            opt.second_step(zero_grad=True)
            trajectory.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    finally:
        torch.set_num_threads(previous)
    state = opt.state_dict()["param_groups"][0]["gearsam"]
    return {"w": trajectory, "ema": state["ema"], "radius": state["radius"]}


@pytest.mark.heavy  # processes: the default tier's one case runs on 4 ranks
@pytest.mark.parametrize("world", WORLDS)
def test_bf16_mixed_precision_equals_its_single_process_computation(request, world):
    """param_dtype=bf16 computes forward and backward in bf16 (reduce_dtype=float32) and the step runs on the float32
        shards: bit for bit what one process computes that way for each rank's slice (:func:`single_process_bf16`). The
        ranks' gradients differ from one process's only in the order they are summed in, and each is a bfloat16 value (8
        significant bits) divided by a power of two, so their float32 sum over 2 or 4 ranks is exact, whatever the order,
    for these gradients (a sum of values whose exponents span more than float32's extra 16 bits would not be)."""
    ranks = everything(request, world)
    got, want = ranks[0]["gear-sam-bf16"], single_process_bf16(world)
    assert got["w"][-1].dtype == torch.float32
    for step in range(STEPS):
        assert torch.equal(got["w"][step], want["w"][step]), step
    assert torch.equal(got["ema"], want["ema"]) and torch.equal(got["radius"], want["radius"])
    assert rel_err(got["w"][-1].double(), ranks[0]["gear-sam"]["w"][-1].double()) > 1e-4  # bfloat16 is not float32


@pytest.mark.heavy  # processes: the default tier's one case runs on 4 ranks
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("plain_pass", ["first", "second"])
def test_the_bf16_check_catches_a_pass_run_in_float32(request, world, plain_pass):
    """Had one pass run in float32, the run would differ from the bf16 computation from the first step on, by far
    more than a rounding: the bit-for-bit comparison above fails for it."""
    got = everything(request, world)[0]["gear-sam-bf16"]["w"]
    one = single_process_bf16(world, bf16=(plain_pass == "second", plain_pass == "first"))["w"]
    assert rel_err(got[0].double(), one[0].double()) > 1e-5
    assert not any(torch.equal(a, b) for a, b in zip(got, one))


@pytest.mark.heavy  # processes: the default tier's one case runs on 4 ranks
@pytest.mark.parametrize("world", WORLDS)
def test_blocks_are_the_bare_models_and_auto_picks_the_sharded_backend(request, world):
    ranks = everything(request, world)
    for name, scenario in SCENARIOS.items():
        if name not in ranks[0]:
            continue  # a scenario no selected case reads was not run
        assert ranks[0][name]["blocks"] == single_process(name, world)["blocks"]
        assert ranks[0][name]["backend"] == ("sharded" if scenario.backend == "auto" else scenario.backend)
    # FSDP2's classes looked through, the frozen unit in no block
    assert ranks[0]["gear-sam"]["blocks"] == ["stem", "stage", "extra", "classifier"]


@pytest.mark.heavy  # processes: the default tier's one case runs on 4 ranks
@pytest.mark.parametrize("world", WORLDS)
def test_flat_buffer_backends_and_m_sharpness_are_refused_on_shards(request, world):
    refused = everything(request, world)[0]["refused"]
    assert set(refused) == {"torch", "cpp", "m_sharpness"}
    for backend in ("torch", "cpp"):
        assert "re-homes parameters into flat buffers" in refused[backend] and "FSDP2" in refused[backend]
    assert "m_sharpness is not supported on a fully_shard (FSDP2) model" in refused["m_sharpness"]


def test_zero_redundancy_optimizer_is_refused_with_the_reason():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    with pytest.raises(ValueError, match="ZeroRedundancyOptimizer as base optimizer is not supported"):
        SAM(make_net(), ZeroRedundancyOptimizer, optimizer_class=torch.optim.SGD, lr=0.1)


# ------------------------------------------------------------------------------ sharded checkpoints
CHECKPOINT_AT = 4
CHECKPOINT_APIS = ("state_dict", "distributed state_dict")


def _checkpointed(model: nn.Module) -> GEARSAM:
    return GEARSAM(model, torch.optim.AdamW, partition="coarse", rho=0.05, beta=0.9, lr=1e-2, weight_decay=0.01)


def _states(model: nn.Module, opt, api: str) -> dict:
    """What a checkpoint holds, by ``api``: the modules' own state dicts, or those of
    ``torch.distributed.checkpoint.state_dict``."""
    if api == "state_dict":
        return {"model": model.state_dict(), "optim": opt.state_dict()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _save_and_go_on(rank: int, world: int, directory: str) -> list[torch.Tensor]:
    """The uninterrupted run, saving a DCP checkpoint (one per API) after ``CHECKPOINT_AT`` steps."""
    import torch.distributed.checkpoint as dcp

    data = rank_data(rank, world)
    model = shard(make_net(), SCENARIOS["gear-sam"])
    opt = _checkpointed(model)
    train(model, opt, data[:CHECKPOINT_AT])
    for api in CHECKPOINT_APIS:
        dcp.save(_states(model, opt, api), checkpoint_id=f"{directory}/{api}")
    return train(model, opt, data[CHECKPOINT_AT:], start=CHECKPOINT_AT)


def _resume(rank: int, world: int, directory: str) -> dict[str, list[torch.Tensor]]:
    """Per API: a fresh model and optimizer, the checkpoint loaded in place, the rest of the run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    data = rank_data(rank, world)
    out = {}
    for api in CHECKPOINT_APIS:
        torch.manual_seed(1234)  # other initial weights: everything must come from the checkpoint
        model = shard(Net(), SCENARIOS["gear-sam"])
        opt = _checkpointed(model)
        opt.init_state()  # DCP loads in place, into state that exists
        states = _states(model, opt, api)
        dcp.load(states, checkpoint_id=f"{directory}/{api}")
        if api == "state_dict":
            model.load_state_dict(states["model"])
            opt.load_state_dict(states["optim"])
        else:
            set_model_state_dict(model, states["model"])
            set_optimizer_state_dict(model, opt, states["optim"])
        out[api] = train(model, opt, data[CHECKPOINT_AT:], start=CHECKPOINT_AT)
    return out


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> tuple[str, list]:
    """(the directory of the checkpoints, every rank's uninterrupted run after them), on 2 ranks."""
    directory = str(tmp_path_factory.mktemp("dcp"))
    return directory, run_ranks(_save_and_go_on, 2, directory, world=2)


def test_a_run_resumed_from_a_sharded_checkpoint_in_new_processes_continues_bit_for_bit(checkpointed):
    directory, uninterrupted = checkpointed
    world = len(uninterrupted)
    resumed = run_ranks(_resume, world, directory, world=world)
    for rank in range(world):
        for api in CHECKPOINT_APIS:
            for step, (got, want) in enumerate(zip(resumed[rank][api], uninterrupted[rank])):
                assert torch.equal(got, want), (rank, api, CHECKPOINT_AT + step)


def test_the_gear_ema_is_saved_once_and_the_optimizer_state_by_name(checkpointed):
    """In each checkpoint the EMA (the same on every rank) is written by one rank only; with the distributed state
    dict the base optimizer's state is keyed by parameter name."""
    import torch.distributed.checkpoint as dcp

    directory, _ = checkpointed
    for api in CHECKPOINT_APIS:
        metadata = dcp.FileSystemReader(f"{directory}/{api}").read_metadata()
        ema = "optim.param_groups.0.gearsam.ema"
        assert ema in metadata.state_dict_metadata
        assert sum(index.fqn == ema for index in metadata.storage_data) == 1, api
    assert "optim.state.stem.weight.exp_avg" in metadata.state_dict_metadata


# ------------------------------------------------------------------------------ the README's example
def readme_example() -> tuple[str, str]:
    """The FSDP2 block of the documentation (its distributed page), and where it is."""
    return needs_block("# needs: torch.distributed and FSDP2")


def _readme_example(rank: int, world: int, directory: str) -> dict:
    """The README's FSDP2 block as written, on a ResNet-18 (BatchNorm included), then its ``resume`` into a fresh
    model and optimizer."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(2 * world, 3, 32, 32, generator=g), torch.randint(0, 10, (2 * world,), generator=g))
               for _ in range(2)]  # fmt: skip
    loader = [(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]) for x, y in batches]
    torch.manual_seed(0)  # every rank builds the same model before sharding it
    namespace = {"model": resnet18(width=4), "loader": loader, "checkpoint_dir": directory}
    exec(compile(*readme_example(), "exec"), namespace)
    model, opt = namespace["model"], namespace["opt"]
    torch.manual_seed(1)
    fresh = resnet18(width=4)
    for module in fresh.children():
        if any(p.requires_grad for p in module.parameters()):
            fully_shard(module)
    fully_shard(fresh)
    fresh_opt = GEARSAM(fresh, torch.optim.AdamW, lr=1e-3)
    namespace["resume"](fresh, fresh_opt, directory)
    saved, loaded = opt.state_dict(), fresh_opt.state_dict()
    return {
        "blocks": opt.block_names, "backend": opt.backend_name,
        "same weights": all(torch.equal(whole(p), whole(q)) for p, q in zip(model.parameters(), fresh.parameters())),
        "same moments": all(torch.equal(whole(saved["state"][i]["exp_avg"]), whole(loaded["state"][i]["exp_avg"]))
                            for i in saved["state"]),
        "same ema": torch.equal(saved["param_groups"][0]["gearsam"]["ema"], loaded["param_groups"][0]["gearsam"]["ema"]),
    }  # fmt: skip


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the example shards onto fully_shard's default mesh, a CUDA one "
    "where a GPU is visible, and this test runs gloo on CPU",
)
def test_the_readme_example_trains_saves_and_resumes(tmp_path):
    for out in run_ranks(_readme_example, 2, str(tmp_path), world=2):
        assert out["backend"] == "sharded"
        assert out["blocks"] == ["stem", "layer1", "layer2", "layer3", "layer4", "classifier"]
        assert out["same weights"] and out["same moments"] and out["same ema"]


# ------------------------------------------------------------------------------ NCCL, on a machine with 2 GPUs
def _on_gpus(rank: int, name: str) -> dict:
    """``name``'s scenario sharded over 2 GPUs; rank 0 also runs one process on the whole batch on its GPU."""
    world, device = 2, torch.device("cuda", rank)
    scenario = SCENARIOS[name]
    data = [(x.to(device), y.to(device)) for x, y in rank_data(rank, world)]
    model = shard(make_net().to(device), scenario)
    out = {"w": [w.cpu() for w in train(model, make_optimizer(model, scenario), data, scenario.driver)]}
    if rank == 0:
        single = make_net().to(device)
        whole_batch = [(x.to(device), y.to(device)) for x, y in batches(world)]
        out["single"] = [w.cpu() for w in train(single, make_optimizer(single, scenario), whole_batch, scenario.driver)]
    return out


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("name", ["sam", "asam", "gear-sam"])
def test_nccl_on_two_gpus_equals_one_process(name):
    rank0, rank1 = run_ranks(_on_gpus, name, world=2, backend="nccl")
    for step in range(STEPS):
        assert torch.equal(rank0["w"][step], rank1["w"][step]), step
        err = rel_err(rank0["w"][step].double(), rank0["single"][step].double())
        assert err <= FP32_STEP_RTOL * (step + 1), f"step {step}: relative error {err:.3g}"
