"""DistributedDataParallel: SAM and GEAR-SAM on two gloo processes (127.0.0.1), every backend, plain and m-sharpness.

Every rank trains the same model on its shard of a global batch. The expected results come from one process doing
DDP's all-reduce by hand: one replica per rank, each computing its shard's gradient, averaged as DDP averages them
(each rank's gradient halved, then summed). For two ranks that is exact arithmetic (halving is exact and
``a + b == b + a``), so a DDP run must reproduce it bit for bit: any gradient DDP did not reduce, or one our flat
buffers missed, shows. A single process on the concatenated batch agrees only to rounding (its mean over all samples
is summed in another order), so that comparison has a per-step fp32 tolerance.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.parallel import DistributedDataParallel as DDP

from gearsam_fused import GEARSAM, available_backends
from gearsam_fused.backends.triton_backend import interpreter_enabled
from gearsam_fused.distributed import sam_step

from conftest import FP32_STEP_RTOL, FP64_STEP_RTOL, on_device, rel_err, tiny_resnet
from ranks import run_ranks, run_ranks_once

WORLD = 2
PER_RANK = 4  # samples per rank and step
STEPS = 3
SEED = 100  # rank r builds its model from SEED + r: DDP's broadcast from rank 0 must make them equal
HP = dict(rho=0.05, beta=0.9, delta=1e-12)
SGD = dict(lr=0.1, momentum=0.9, weight_decay=5e-4)


def everything() -> list[dict]:
    """Every rank's results of :func:`_everything`, computed on the first call; its failure fails every caller."""
    return run_ranks_once(_everything, world=WORLD)


def _boom(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")


def test_a_failing_rank_fails_the_test_with_its_traceback():
    with pytest.raises(mp.ProcessRaisedException) as info:
        run_ranks(_boom, world=WORLD)
    message = str(info.value)
    assert "Traceback" in message and "in _boom" in message and "rank 1 fails on purpose" in message


# ------------------------------------------------------------------------------ models, data, helpers
def _mlp(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """BatchNorm-free: DDP has no buffers to broadcast."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.SiLU(), nn.Linear(10, 3)).to(dtype)


def _data(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, steps: int = STEPS):
    g = torch.Generator().manual_seed(7)
    n = WORLD * PER_RANK
    return [
        (torch.randn(n, *shape, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)
    ]


def _shard(xy, rank: int):
    x, y = xy
    return x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]


def _gearsam(model: nn.Module, backend: str, partition="tensor") -> GEARSAM:
    return GEARSAM(model.parameters(), torch.optim.SGD, model=model, partition=partition, backend=backend, **HP, **SGD)


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _local_grads(model: nn.Module, xy) -> list[torch.Tensor]:
    """This shard's gradient, left in ``.grad`` and returned as copies."""
    model.zero_grad(set_to_none=True)
    x, y = xy
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _all_reduce_by_hand(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """DDP's average: every rank's gradient divided by the world size, then summed."""
    return [torch.stack(gs).div_(WORLD).sum(0) for gs in zip(*per_rank)]


def _set_grads(model: nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


def _flat_grad(opt, p: torch.Tensor) -> torch.Tensor | None:
    """Where a fused backend keeps ``p``'s gradient (None for the reference backend)."""
    layout = getattr(opt.backend, "layout", None)
    if layout is None:
        return None
    return next(slot.grad_view for bucket in layout.buckets for slot in bucket.slots if slot.param is p)


def _by_hand(make_model, data, backend: str, m_sharpness: bool, partition="tensor") -> dict:
    """One process, one replica per rank, DDP's all-reduce done by hand (m-sharpness: not in the first pass)."""
    models = [make_model(SEED) for _ in range(WORLD)]  # rank 0's initial weights, which DDP broadcasts
    opts = [_gearsam(m, backend, partition) for m in models]
    out = {"w": [], "perturbed": [[] for _ in range(WORLD)], "buffers": None}
    for xy in data:
        shards = [_shard(xy, r) for r in range(WORLD)]
        first = [_local_grads(m, s) for m, s in zip(models, shards)]
        if not m_sharpness:
            reduced = _all_reduce_by_hand(first)
            for m in models:
                _set_grads(m, reduced)
        for r, (m, opt) in enumerate(zip(models, opts)):
            opt.first_step(zero_grad=True)
            out["perturbed"][r].append(_weights(m).clone())
        reduced = _all_reduce_by_hand([_local_grads(m, s) for m, s in zip(models, shards)])
        for m, opt in zip(models, opts):
            _set_grads(m, reduced)
            opt.second_step(zero_grad=True)
        assert _same_bits(_weights(models[0]), _weights(models[1]))
        out["w"].append(_weights(models[0]).clone())
    # rank 0 is DDP's buffer source, so its running statistics only ever see shard 0: replica 0's
    out["buffers"] = {k: v.clone() for k, v in models[0].named_buffers()}
    return out


# ------------------------------------------------------------------------------ every backend, every way of driving
class Config(NamedTuple):
    driver: str  # "manual": the documented first_step/second_step loop; "helper"/"m-sharpness": sam_step
    set_to_none: bool
    bucket_view: bool  # DDP(gradient_as_bucket_view=...)
    optimizer_first: bool  # optimizer built (parameters re-homed) before DDP wraps the model

    @property
    def id(self) -> str:
        return "-".join([
            self.driver, "none" if self.set_to_none else "zeros", "bucketview" if self.bucket_view else "copy",
            "optfirst" if self.optimizer_first else "ddpfirst",
        ])  # fmt: skip


CONFIGS = [
    Config(d, s, v, o)
    for d in ("manual", "helper", "m-sharpness")
    for s in (True, False)
    for v in (False, True)
    for o in (False, True)
]
BACKENDS = [on_device(b, "cpu") for b in ("reference", "torch", "triton", "cpp", "sharded")]
CASES = [pytest.param(b.values[0], c, marks=b.marks, id=f"{b.values[0]}-{c.id}") for b in BACKENDS for c in CONFIGS]
BACKEND_CASES = [pytest.param(b.values[0], marks=b.marks, id=b.values[0]) for b in BACKENDS]


def _ddp_run(rank: int, backend: str, config: Config, data) -> dict:
    model = _mlp(SEED + rank)
    if config.optimizer_first:
        opt = _gearsam(model, backend)
        ddp = DDP(model, gradient_as_bucket_view=config.bucket_view)
    else:
        ddp = DDP(model, gradient_as_bucket_view=config.bucket_view)
        opt = _gearsam(ddp, backend)
    params = list(model.parameters())
    fused = _flat_grad(opt, params[0]) is not None
    out = {"w0": _weights(model).clone(), "w": [], "perturbed": [], "first_call_at_w": [], "facts": []}
    for xy in data:
        x, y = _shard(xy, rank)
        w = _weights(model).clone()
        if config.driver == "manual":
            opt.zero_grad(set_to_none=config.set_to_none)
            F.cross_entropy(ddp(x), y).backward()
            reduced = [p.grad.clone() for p in params]
            opt.first_step()
            out["perturbed"].append(_weights(model).clone())
            facts = {}
            if fused:
                # what the step just read: the flat buffer, which must hold DDP's reduced gradient
                facts["flat_holds_reduced"] = all(
                    p.grad is _flat_grad(opt, p) and torch.equal(p.grad, g) for p, g in zip(params, reduced)
                )
            opt.zero_grad(set_to_none=config.set_to_none)
            F.cross_entropy(ddp(x), y).backward()
            if fused:
                storages = {p.grad.untyped_storage().data_ptr() for p in params}
                ours = {bucket.grad.untyped_storage().data_ptr() for bucket in opt.backend.layout.buckets}
                facts["grad_is_flat_view"] = [p.grad is _flat_grad(opt, p) for p in params]
                facts["grad_in_flat_storage"] = bool(storages & ours)
                facts["grad_storages"] = len(storages)
                facts["flat_differs"] = any(not torch.equal(p.grad, _flat_grad(opt, p)) for p in params)
            out["facts"].append(facts)
            opt.second_step()
        else:
            seen = []

            def closure():
                seen.append(_weights(model).clone())
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                return loss

            sam_step(opt, ddp, closure, m_sharpness=config.driver == "m-sharpness", set_to_none=config.set_to_none)
            out["first_call_at_w"].append(_same_bits(seen[0], w))
            out["perturbed"].append(seen[1])
        out["w"].append(_weights(model).clone())
    return out


def _single_process(backend: str, data) -> list[torch.Tensor]:
    model = _mlp(SEED)
    opt = _gearsam(model, backend)
    trajectory = []
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        opt.first_step(zero_grad=True)
        F.cross_entropy(model(x), y).backward()
        opt.second_step(zero_grad=True)
        trajectory.append(_weights(model).clone())
    return trajectory


def _train_every_config(rank: int, backend: str) -> dict:
    data = _data((6,))
    out = {"runs": {c.id: _ddp_run(rank, backend, c, data) for c in CONFIGS}}
    if rank == 0:
        out["expected"] = {
            "plain": _by_hand(_mlp, data, backend, m_sharpness=False),
            "m-sharpness": _by_hand(_mlp, data, backend, m_sharpness=True),
            "concatenated": _single_process(backend, data),
        }
    return out


def _trained(backend: str) -> tuple[dict, dict, dict]:
    """(rank 0's results, rank 1's, expected) of every config."""
    rank0, rank1 = (out["train"][backend] for out in everything())
    return rank0["runs"], rank1["runs"], rank0["expected"]


@pytest.mark.parametrize("backend,config", CASES)
def test_ranks_stay_bitwise_identical(backend, config):
    runs0, runs1, _ = _trained(backend)
    a, b = runs0[config.id], runs1[config.id]
    assert _same_bits(a["w0"], b["w0"])  # DDP's broadcast reached the parameters, wherever they live
    assert len(a["w"]) == STEPS
    for step in range(STEPS):
        assert _same_bits(a["w"][step], b["w"][step]), f"ranks differ after step {step}"
        same_perturbation = _same_bits(a["perturbed"][step], b["perturbed"][step])
        if config.driver == "m-sharpness":
            assert not same_perturbation, f"step {step}: both ranks perturbed alike, so not with their own gradients"
        else:
            assert same_perturbation, f"step {step}: ranks perturbed differently although the gradient is reduced"
    if config.driver != "manual":
        assert a["first_call_at_w"] == [True] * STEPS  # sam_step's first pass runs at the unperturbed weights


@pytest.mark.parametrize("backend,config", CASES)
def test_equals_the_all_reduce_done_by_hand(backend, config):
    runs0, runs1, expected = _trained(backend)
    want = expected["m-sharpness" if config.driver == "m-sharpness" else "plain"]
    for step in range(STEPS):
        for rank, run in enumerate((runs0[config.id], runs1[config.id])):
            where = f"rank {rank}, step {step}"
            assert torch.equal(run["perturbed"][step], want["perturbed"][rank][step]), f"{where}: w + eps"
            assert torch.equal(run["w"][step], want["w"][step]), f"{where}: weights after second_step"


@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_plain_equals_one_process_on_the_concatenated_batch(backend):
    runs0, _, expected = _trained(backend)
    reference = expected["concatenated"]
    w0 = runs0[CONFIGS[0].id]["w0"]
    for config in CONFIGS:
        if config.driver == "m-sharpness":
            continue
        trajectory = runs0[config.id]["w"]
        for step in range(STEPS):
            assert rel_err(trajectory[step].double(), reference[step].double()) <= FP32_STEP_RTOL, (config.id, step)
    assert rel_err(reference[-1].double(), w0.double()) > 1e-3  # the runs really moved


@pytest.mark.parametrize("backend", [c for c in BACKEND_CASES if c.values[0] not in ("reference", "sharded")])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeros"])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["copy", "bucketview"])
def test_flat_buffers_and_ddp_buckets_coexist(backend, set_to_none, bucket_view):
    """first_step reads DDP's reduced gradient; after the next backward, DDP's bucket views are .grad again while the
    flat buffer still holds older values, which nothing reads (the step equals the by-hand all-reduce above)."""
    runs0, runs1, _ = _trained(backend)
    for optimizer_first in (False, True):
        config = Config("manual", set_to_none, bucket_view, optimizer_first)
        for facts in runs0[config.id]["facts"] + runs1[config.id]["facts"]:
            assert facts["flat_holds_reduced"]
            if bucket_view:
                # every .grad is a view of DDP's one bucket (this model is small), none lies in our buffers
                assert not facts["grad_in_flat_storage"] and facts["grad_storages"] == 1
            elif not set_to_none:
                assert all(facts["grad_is_flat_view"])  # DDP copied the reduced gradient into our views
            # stale flat values exist exactly when .grad lives elsewhere
            assert facts["flat_differs"] == (bucket_view or set_to_none)


def _recording_closure(model, ddp, x, y, seen: list):
    """Forward and backward through ``ddp``, first appending the weights it runs at to ``seen``."""

    def closure():
        seen.append(_weights(model).clone())
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        return loss

    return closure


# ------------------------------------------------------------------------------ a model with BatchNorm buffers
def _batchnorm_run(rank: int, backend: str) -> dict:
    data = _data((3, 8, 8), steps=2)
    out = {}
    for m_sharpness in (False, True):
        model = tiny_resnet(SEED + rank)
        ddp = DDP(model, gradient_as_bucket_view=True)  # broadcast_buffers: rank 0's running statistics, every step
        opt = _gearsam(model, backend, partition="coarse")
        run = {"w": [], "perturbed": []}
        for xy in data:
            x, y = _shard(xy, rank)
            closure = _recording_closure(model, ddp, x, y, run["perturbed"])
            sam_step(opt, ddp, closure, m_sharpness=m_sharpness, set_to_none=False)
            del run["perturbed"][-2]  # keep the call at w + eps
            run["w"].append(_weights(model).clone())
        run["buffers"] = {k: v.clone() for k, v in model.named_buffers()}
        run["blocks"] = opt.block_names
        key = "m-sharpness" if m_sharpness else "plain"
        out[key] = run
        if rank == 0:
            out["expected-" + key] = _by_hand(tiny_resnet, data, backend, m_sharpness, partition="coarse")
    return out


@pytest.mark.parametrize("mode", ["plain", "m-sharpness"])
def test_batchnorm_model(mode):
    rank0, rank1 = (out["batchnorm"] for out in everything())
    a, b, want = rank0[mode], rank1[mode], rank0["expected-" + mode]
    assert len(a["blocks"]) > 1  # GEAR-SAM really splits the radius
    for step in range(len(a["w"])):
        assert _same_bits(a["w"][step], b["w"][step])
        assert torch.equal(a["w"][step], want["w"][step]) and torch.equal(b["w"][step], want["w"][step])
        for rank, run in enumerate((a, b)):
            assert torch.equal(run["perturbed"][step], want["perturbed"][rank][step])
    assert a["buffers"].keys() == want["buffers"].keys()
    assert all(torch.equal(a["buffers"][k], want["buffers"][k]) for k in want["buffers"])


# ------------------------------------------------------------------------------ m-sharpness from the formulas
def _gear_sam_m_sharpness_float64(data) -> dict:
    """Per-rank GEAR-SAM perturbations (own EMA, one block per tensor), averaged gradient at the perturbed points,
    SGD with momentum and weight decay; written from the equations, in float64."""
    model = _mlp(SEED, torch.float64)
    names = [n for n, _ in model.named_parameters()]
    w = [p.detach().clone() for p in model.parameters()]

    def grads(weights, xy):
        weights = [t.detach().requires_grad_() for t in weights]
        x, y = xy
        loss = F.cross_entropy(functional_call(model, dict(zip(names, weights)), (x,)), y)
        return torch.autograd.grad(loss, weights)

    ema = [torch.zeros(len(w), dtype=torch.float64) for _ in range(WORLD)]
    momentum = None
    out = {"w": [], "perturbed": [[] for _ in range(WORLD)]}
    for xy in data:
        at_perturbed = []
        for r in range(WORLD):
            shard = _shard(xy, r)
            g = grads(w, shard)
            energy = torch.stack([gi.square().sum() for gi in g])
            ema[r] = HP["beta"] * ema[r] + (1 - HP["beta"]) * energy
            radius = HP["rho"] * ema[r] / ema[r].norm() if ema[r].norm() > 0 else torch.zeros_like(ema[r])
            perturbed = [wi + rb * gi / (eb.sqrt() + HP["delta"]) for wi, gi, rb, eb in zip(w, g, radius, energy)]
            out["perturbed"][r].append(torch.cat([t.reshape(-1) for t in perturbed]))
            at_perturbed.append(grads(perturbed, shard))
        update = [(g0 + g1) / 2 + SGD["weight_decay"] * wi for g0, g1, wi in zip(*at_perturbed, w)]
        momentum = update if momentum is None else [SGD["momentum"] * m + u for m, u in zip(momentum, update)]
        w = [wi - SGD["lr"] * m for wi, m in zip(w, momentum)]
        out["w"].append(torch.cat([t.reshape(-1) for t in w]))
    return out


def _m_sharpness_float64_run(rank: int, backends: tuple[str, ...]) -> dict:
    data = _data((6,), torch.float64)
    out = {}
    for backend in backends:
        model = _mlp(SEED, torch.float64)
        ddp = DDP(model)
        opt = _gearsam(ddp, backend)
        run = {"w": [], "perturbed": []}
        for xy in data:
            x, y = _shard(xy, rank)
            closure = _recording_closure(model, ddp, x, y, run["perturbed"])
            sam_step(opt, ddp, closure, m_sharpness=True)
            del run["perturbed"][-2]
            run["w"].append(_weights(model).clone())
        out[backend] = run
    if rank == 0:
        out["expected"] = _gear_sam_m_sharpness_float64(data)
    return out


def _installed_backends() -> tuple[str, ...]:
    return tuple(b for b in available_backends() if b != "triton" or interpreter_enabled())


@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_m_sharpness_equals_the_formulas(backend):
    rank0, rank1 = (out["m-sharpness float64"] for out in everything())
    want = rank0["expected"]
    for rank, out in enumerate((rank0, rank1)):
        run = out[backend]
        for step in range(STEPS):
            assert rel_err(run["perturbed"][step], want["perturbed"][rank][step]) <= FP64_STEP_RTOL, (rank, step)
            assert rel_err(run["w"][step], want["w"][step]) <= FP64_STEP_RTOL, (rank, step)
    assert rel_err(want["perturbed"][0][0], want["perturbed"][1][0]) > 1e-6  # the ranks' perturbations differ


# ------------------------------------------------------------------------------ what sam_step refuses, static graphs
def _static_graph_and_refusals(rank: int) -> dict:
    data = _data((6,))
    model = _mlp(SEED + rank)
    ddp = DDP(model, static_graph=True)
    opt = _gearsam(ddp, "torch")

    def closure_on(net, xy):
        def closure():
            x, y = _shard(xy, rank)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss

        return closure

    out = {"w": [], "refused": {}}
    for what, call in (
        ("bare module", lambda: sam_step(opt, model, closure_on(model, data[0]))),  # its passes would not be reduced
        ("static graph", lambda: sam_step(opt, ddp, closure_on(ddp, data[0]), m_sharpness=True)),  # fails in no_sync
    ):
        try:
            call()
        except (TypeError, ValueError) as exc:
            out["refused"][what] = f"{type(exc).__name__}: {exc}"
    for xy in data:
        sam_step(opt, ddp, closure_on(ddp, xy))
        out["w"].append(_weights(model).clone())
    if rank == 0:
        out["expected"] = _by_hand(_mlp, data, "torch", m_sharpness=False)
    return out


def test_static_graph_plain_works_and_m_sharpness_is_refused():
    rank0, rank1 = (out["static graph"] for out in everything())
    for step in range(STEPS):
        assert _same_bits(rank0["w"][step], rank1["w"][step])
        assert torch.equal(rank0["w"][step], rank0["expected"]["w"][step])
    for out in (rank0, rank1):
        refused = out["refused"]["static graph"]
        assert refused.startswith("ValueError") and "static_graph" in refused


def test_sam_step_refuses_a_bare_module_while_ranks_train():
    for out in everything():
        refused = out["static graph"]["refused"]["bare module"]
        assert refused.startswith("TypeError") and "DistributedDataParallel" in refused


def _everything(rank: int) -> dict:
    """All the multi-process work of this module, in one process group: a process that builds a DDP module spends
    seconds importing (DDP imports torch._dynamo), so the module pays that once."""
    backends = _installed_backends()
    return {
        "train": {b: _train_every_config(rank, b) for b in backends},
        "batchnorm": _batchnorm_run(rank, "auto"),
        "m-sharpness float64": _m_sharpness_float64_run(rank, backends),
        "static graph": _static_graph_and_refusals(rank),
    }


# ------------------------------------------------------------------------------ sam_step in a single process
@pytest.mark.parametrize("m_sharpness", [False, True])
def test_sam_step_without_process_group_is_the_documented_loop(m_sharpness):
    data = _data((6,))
    model, twin = _mlp(SEED), _mlp(SEED)
    opt, twin_opt = _gearsam(model, "torch"), _gearsam(twin, "torch")
    for x, y in data:

        def closure():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        loss = sam_step(opt, model, closure, m_sharpness=m_sharpness)
        first = F.cross_entropy(twin(x), y)
        first.backward()
        twin_opt.first_step(zero_grad=True)
        F.cross_entropy(twin(x), y).backward()
        twin_opt.second_step(zero_grad=True)
        assert torch.equal(loss, first)
        assert _same_bits(_weights(model), _weights(twin))


def test_sam_step_checks_its_arguments():
    model = _mlp(SEED)
    opt = _gearsam(model, "torch")

    def closure():
        loss = F.cross_entropy(model(torch.zeros(2, 6)), torch.zeros(2, dtype=torch.long))
        loss.backward()
        return loss

    with pytest.raises(TypeError, match="optimizer must be a gearsam_fused SAM or GEARSAM, got SGD"):
        sam_step(torch.optim.SGD(model.parameters(), lr=0.1), model, closure)
    with pytest.raises(TypeError, match="closure"):
        sam_step(opt, model, None)
    with pytest.raises(TypeError, match="m_sharpness"):
        sam_step(opt, model, closure, m_sharpness=1)
