"""MomentumSAM on two gloo processes (127.0.0.1): over a DDP module (the ``torch`` and ``cpp`` backends) and over a
model sharded by FSDP2's ``fully_shard`` (the ``sharded`` backend), with SAM's allocation (SGD) and GEAR-SAM's (AdamW).

MomentumSAM takes one gradient per step, at the look-ahead point the parameters hold, and perturbs along the base
optimizer's momentum, which is the same on every rank once the gradient is reduced. Under DDP the one all-reduce is
DDP's own and the optimizer adds none: every rank must hold bitwise the same weights, and equal bit for bit one process
that averages the ranks' gradients by hand as DDP does (for two ranks that is exact arithmetic, see test_ddp.py). Under
FSDP2 each rank holds a shard of the momentum, so its energies are partial sums, added up over the ranks by one
all-reduce of a ``[B]`` vector: the trajectory equals one process running the ``reference`` backend on the whole
batch, within the suite's per-step float32 tolerance, and ``opt.eval()`` puts the whole ``w`` back in the shards.

A sharded checkpoint (``torch.distributed.checkpoint``) saved in eval mode resumes bit for bit; one saved in train mode
does not load into a fresh optimizer (docs/distributed.md). All the multi-process work runs once, in one process group,
and every test reads its part.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from gearsam_fused import MomentumSAM
from gearsam_fused.distributed import sam_step
from gearsam_fused.sharding import local

from conftest import FP32_STEP_RTOL, on_device, rel_err
from ranks import run_ranks_once, selected_values

pytest.importorskip("torch.distributed.fsdp")
import test_fsdp as fsdp  # noqa: E402
from test_ddp import PER_RANK, SEED, WORLD, _mlp, _same_bits, _shard, _weights  # noqa: E402

#: Steps of every run: the first has no momentum yet (its gradient is taken at ``w``) and the later ones look ahead;
#: the FSDP2 model's "extra" unit runs on even steps only, so on odd ones its momentum is a direction without a gradient
STEPS = 6
#: name -> (allocation, base optimizer, its arguments): SAM's global radius over SGD's momentum buffer, GEAR-SAM's
#: per-block radii over Adam's first moment
METHODS = {
    "sam": ("sam", torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=5e-4)),
    "gear": ("gear", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01)),
}
RHO = 0.1
#: How far the look-ahead's length may be from the radius it was given: ``w~ - w`` is the difference of two float32
#: weight vectors, each rounded to half an ulp (a relative 6e-8 of the weights, whose norm here is a few), over RHO
LENGTH_RTOL = 1e-5


def _momentum_sam(model, method: str, backend: str, partition: str) -> MomentumSAM:
    allocation, base, kwargs = METHODS[method]
    return MomentumSAM(model, base, rho=RHO, allocation=allocation, beta=0.9, partition=partition, backend=backend,
                       **kwargs)  # fmt: skip


COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")


@contextlib.contextmanager
def _counting_collectives():
    """Every ``torch.distributed`` collective called inside, as (name, shape, dtype) of its first tensor argument:
    the library calls them through ``torch.distributed``'s module attributes (DDP's reducer and FSDP2's hooks do not
    run inside an optimizer step)."""
    calls: list[tuple] = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name, fn):
        def collective(*args, **kwargs):
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            calls.append((name, None if tensor is None else tuple(tensor.shape), getattr(tensor, "dtype", None)))
            return fn(*args, **kwargs)

        return collective

    for name, fn in saved.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _after_step(opt: MomentumSAM, weights, record: dict) -> None:
    """Record the look-ahead point the parameters hold (train mode), ``w`` (eval mode), whether train mode put back
    the same bits, and the step's statistics."""
    shards = [local(p).detach().clone() for block in opt.blocks for p in block.params]
    record["lookahead"].append(weights())
    opt.eval()
    record["w"].append(weights())
    record["eval_training"].append(opt.training)
    opt.train()
    back = [local(p) for block in opt.blocks for p in block.params]
    record["back"].append(all(_same_bits(a, b) for a, b in zip(shards, back)))
    stats = opt.step_statistics
    record["energy"].append(stats.energy.clone())
    record["radius"].append(stats.radius.clone())


def _record() -> dict:
    return {key: [] for key in ("lookahead", "w", "eval_training", "back", "energy", "radius", "collectives")}


# ------------------------------------------------------------------------------ DDP
def _ddp_data():
    g = torch.Generator().manual_seed(11)
    n = WORLD * PER_RANK
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(STEPS)]


def _counting_hook(state: dict, bucket):
    """DDP's all-reduce, counted."""
    state["all-reduces"] += 1
    return allreduce_hook(None, bucket)


def _ddp_run(rank: int, backend: str, method: str) -> dict:
    model = _mlp(SEED + rank)  # DDP's broadcast from rank 0 must make the replicas equal
    ddp = DDP(model)
    hook = {"all-reduces": 0}
    ddp.register_comm_hook(hook, _counting_hook)
    opt = _momentum_sam(ddp, method, backend, "tensor")
    out = {**_record(), "ddp_all_reduces": [], "backend": opt.backend_name, "blocks": len(opt.blocks)}
    for xy in _ddp_data():
        x, y = _shard(xy, rank)
        hook["all-reduces"] = 0
        F.cross_entropy(ddp(x), y).backward()
        with _counting_collectives() as calls:
            opt.step()
            opt.zero_grad()
            _after_step(opt, lambda: _weights(model).clone(), out)
        out["ddp_all_reduces"].append(hook["all-reduces"])
        out["collectives"].append(calls)
    return out


@contextlib.contextmanager
def _one_thread():
    """This process computing as each rank does, on one thread (the order of torch's float sums depends on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _ddp_by_hand(backend: str, method: str) -> dict:
    """One process, DDP's all-reduce done by hand: each shard's gradient at the look-ahead point, halved and summed.
    Computed here, outside the process group, as each rank computes (one thread)."""
    model = _mlp(SEED)
    opt = _momentum_sam(model, method, backend, "tensor")
    params = list(model.parameters())
    out = _record()
    with _one_thread():
        for xy in _ddp_data():
            per_rank = []
            for rank in range(WORLD):
                model.zero_grad(set_to_none=True)
                x, y = _shard(xy, rank)
                F.cross_entropy(model(x), y).backward()
                per_rank.append([p.grad.clone() for p in params])
            for p, grads in zip(params, zip(*per_rank)):
                p.grad = torch.stack(grads).div_(WORLD).sum(0)
            opt.step()
            opt.zero_grad()
            _after_step(opt, lambda: _weights(model).clone(), out)
    return out


@functools.cache
def _ddp_whole_batch(backend: str, method: str) -> dict:
    """One process on the concatenated batch: its mean over all samples is summed in another order."""
    model = _mlp(SEED)
    opt = _momentum_sam(model, method, backend, "tensor")
    out = _record()
    with _one_thread():
        for x, y in _ddp_data():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            _after_step(opt, lambda: _weights(model).clone(), out)
    return out


def _ddp(rank: int, backends: tuple[str, ...]) -> dict:
    return {(backend, method): _ddp_run(rank, backend, method) for backend in backends for method in METHODS}


# ------------------------------------------------------------------------------ FSDP2
def _gathered(model):
    """The whole parameters, gathered on every rank (a collective: every rank calls it at the same point)."""
    return lambda: torch.cat([fsdp.whole(p).reshape(-1) for p in model.parameters()])


def _sharded(method: str, seed: int | None = None):
    """test_fsdp.py's model (a parameter split unevenly, a frozen unit, a unit used on even steps only), one FSDP2 unit
    per layer and the root, and MomentumSAM over it on the ``sharded`` backend."""
    if seed is not None:
        torch.manual_seed(seed)
    model = fsdp.shard(fsdp.make_net() if seed is None else fsdp.Net(), fsdp.SCENARIOS["sam"])
    return model, _momentum_sam(model, method, "sharded", "coarse")


def _fsdp_train(model, opt, data, start: int = 0) -> dict:
    """The steps over ``data`` (the first numbered ``start``), recorded after each."""
    out = _record()
    for step, (x, y) in enumerate(data, start):
        F.cross_entropy(model(x, step), y).backward()
        with _counting_collectives() as calls:
            opt.step()
            opt.zero_grad()
        out["collectives"].append(calls)
        _after_step(opt, _gathered(model), out)
    return out


@functools.cache
def _fsdp_reference(method: str) -> dict:
    """One process (this one, outside the process group), the unsharded model on the whole batch, the ``reference``
    backend."""
    model = fsdp.make_net()
    opt = _momentum_sam(model, method, "reference", "coarse")
    with _one_thread():
        out = _fsdp_train(model, opt, fsdp.batches(WORLD)[:STEPS])
    out["blocks"] = opt.block_names
    return out


def _fsdp(rank: int) -> dict:
    out = {}
    for method in METHODS:
        model, opt = _sharded(method)
        out[method] = _fsdp_train(model, opt, fsdp.rank_data(rank, WORLD)[:STEPS])
        out[method].update(backend=opt.backend_name, blocks=opt.block_names)
    return out


# ------------------------------------------------------------------------------ FSDP2 checkpoints
CHECKPOINT_AT = 3
CHECKPOINT_METHOD = "gear"  # the most state: Adam's moments and step, the GEAR EMA, the look-ahead's scales
APIS = ("state_dict", "distributed state_dict")


def _states(model, opt, api: str) -> dict:
    """What a checkpoint holds, by ``api`` (as test_fsdp.py saves them)."""
    if api == "state_dict":
        return {"model": model.state_dict(), "optim": opt.state_dict()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _load(model, opt, api: str, checkpoint_id: str) -> None:
    """Into a fresh model and optimizer, in place, as docs/distributed.md's ``resume`` does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    opt.init_state()
    states = _states(model, opt, api)
    dcp.load(states, checkpoint_id=checkpoint_id)
    if api == "state_dict":
        model.load_state_dict(states["model"])
        opt.load_state_dict(states["optim"])
    else:
        set_model_state_dict(model, states["model"])
        set_optimizer_state_dict(model, opt, states["optim"])


def _checkpoints(rank: int, apis: tuple[str, ...], directory: str) -> dict:
    """The uninterrupted run, saving after ``CHECKPOINT_AT`` steps in eval mode (each API) and in train mode; then,
    per checkpoint, a fresh model and optimizer (other initial weights) loaded from it and trained on."""
    import torch.distributed.checkpoint as dcp

    data = fsdp.rank_data(rank, WORLD)[:STEPS]
    model, opt = _sharded(CHECKPOINT_METHOD)
    _fsdp_train(model, opt, data[:CHECKPOINT_AT])
    opt.eval()
    saved_w = _gathered(model)()
    for api in apis:
        dcp.save(_states(model, opt, api), checkpoint_id=f"{directory}/eval-{api}")
    opt.train()
    dcp.save(_states(model, opt, "state_dict"), checkpoint_id=f"{directory}/train")
    out = {"uninterrupted": _fsdp_train(model, opt, data[CHECKPOINT_AT:], CHECKPOINT_AT), "eval": {}}
    for api in apis:
        model, opt = _sharded(CHECKPOINT_METHOD, seed=1234)
        _load(model, opt, api, f"{directory}/eval-{api}")
        loaded = {"training": opt.training, "w": torch.equal(_gathered(model)(), saved_w)}
        opt.train()
        out["eval"][api] = {**loaded, "run": _fsdp_train(model, opt, data[CHECKPOINT_AT:], CHECKPOINT_AT)}
    model, opt = _sharded(CHECKPOINT_METHOD, seed=1234)
    try:
        _load(model, opt, "state_dict", f"{directory}/train")
        out["train"] = _fsdp_train(model, opt, data[CHECKPOINT_AT:], CHECKPOINT_AT)
    except Exception:  # noqa: BLE001 - the test reports it
        out["train"] = traceback.format_exc()
    return out


def _everything(rank: int, backends: tuple[str, ...], apis: tuple[str, ...]) -> dict:
    """All the multi-process work of this module, in one process group: a process that builds a DDP or FSDP2 module
    spends seconds importing, so the module pays that once."""
    out = {"ddp": _ddp(rank, backends), "fsdp": _fsdp(rank)}
    directory = [tempfile.mkdtemp(prefix="momentum-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)  # one checkpoint directory, shared by the ranks
    try:
        out["checkpoints"] = _checkpoints(rank, apis, directory[0])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory[0], ignore_errors=True)
    return out


BACKENDS = [on_device(b, "cpu") for b in ("torch", "cpp")]
BACKEND_CASES = [pytest.param(b.values[0], marks=b.marks, id=b.values[0]) for b in BACKENDS]


def everything(request) -> list[dict]:
    """Every rank's results, computed on the first call; its failure fails every caller. The DDP runs cover the
    backends the run's selected cases name, the checkpoints the APIs (the train-mode one always)."""
    backends = tuple(b.values[0] for b in BACKENDS if b.values[0] in selected_values(request, "backend"))
    apis = tuple(api for api in APIS if api in selected_values(request, "api"))
    return run_ranks_once(_everything, backends, apis, world=WORLD)


def _check_lengths(record: dict, method: str, where: str) -> None:
    """The look-ahead's length is the radius: ``||w~ - w|| = rho`` (SAM's one radius; GEAR-SAM's radii with
    ``sum r_b**2 = rho**2``), where every block has momentum. A rank that normalised by its own shard of the momentum
    would move each shard by rho."""
    for step, (lookahead, w) in enumerate(zip(record["lookahead"], record["w"])):
        length = (lookahead.double() - w.double()).norm().item()
        assert abs(length - RHO) <= LENGTH_RTOL * RHO, f"{where}, {method}, step {step}: ||w~ - w|| = {length}"
        radius = record["radius"][step]
        assert abs(radius.square().sum().sqrt().item() - RHO) <= 1e-9 * RHO, (where, method, step, radius)


def _check_modes(record: dict, where: str) -> None:
    assert record["eval_training"] == [False] * STEPS, f"{where}: opt.eval() left train mode"
    assert record["back"] == [True] * STEPS, f"{where}: opt.train() did not put back the look-ahead's bits"


# ------------------------------------------------------------------------------ DDP tests
@pytest.mark.heavy  # processes: the default tier's one case runs the torch backend, both allocations
@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_ddp_ranks_stay_bitwise_identical_with_one_all_reduce_a_step(request, backend):
    rank0, rank1 = (out["ddp"] for out in everything(request))
    for method in METHODS:
        a, b = rank0[backend, method], rank1[backend, method]
        assert a["backend"] == backend and a["blocks"] > 1
        for step in range(STEPS):
            for what in ("lookahead", "w", "energy", "radius"):
                assert _same_bits(a[what][step], b[what][step]), f"{method}, step {step}: the ranks' {what} differ"
        for run in (a, b):
            assert run["ddp_all_reduces"] == [1] * STEPS, run["ddp_all_reduces"]  # one gradient a step, one bucket
            assert run["collectives"] == [[]] * STEPS, run["collectives"]  # and no collective of the optimizer's
            _check_modes(run, method)
        _check_lengths(a, method, "DDP")


@pytest.mark.heavy  # processes: the default tier's one case runs the torch backend, both allocations
@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_ddp_equals_the_all_reduce_done_by_hand(request, backend):
    ranks = [out["ddp"] for out in everything(request)]
    for method in METHODS:
        want = _ddp_by_hand(backend, method)
        for rank, out in enumerate(ranks):
            run = out[backend, method]
            for step in range(STEPS):
                for what in ("lookahead", "w", "energy", "radius"):
                    assert torch.equal(run[what][step], want[what][step]), f"{method}, rank {rank}, step {step}: {what}"


def _assert_same_trajectory(run: dict, want: dict, method: str) -> None:
    """Step by step, the look-ahead points and w within float32's tolerance per step, the energies and radii within
    1e-5 (sums of squares over other splits of the same numbers)."""
    for step in range(STEPS):
        for what in ("lookahead", "w"):
            err = rel_err(run[what][step].double(), want[what][step].double())
            assert err <= FP32_STEP_RTOL, f"{method}, step {step}, {what}: relative error {err:.3g}"
        torch.testing.assert_close(run["energy"][step], want["energy"][step], rtol=1e-5, atol=0)
        torch.testing.assert_close(run["radius"][step], want["radius"][step], rtol=1e-5, atol=0)


@pytest.mark.heavy  # processes: the default tier's one case runs the torch backend, both allocations
@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_ddp_equals_one_process_on_the_whole_batch(request, backend):
    rank0 = everything(request)[0]["ddp"]
    for method in METHODS:
        run, want = rank0[backend, method], _ddp_whole_batch(backend, method)
        _assert_same_trajectory(run, want, method)
        assert rel_err(want["w"][-1].double(), _weights(_mlp(SEED)).double()) > 1e-2  # the runs really moved


# ------------------------------------------------------------------------------ FSDP2 tests
@pytest.mark.heavy  # processes
def test_fsdp_energies_are_summed_over_the_ranks_with_one_all_reduce_a_step(request):
    ranks = [out["fsdp"] for out in everything(request)]
    for method in METHODS:
        a = ranks[0][method]
        assert a["backend"] == "sharded" and a["blocks"] == _fsdp_reference(method)["blocks"]
        assert len(a["blocks"]) > 1
        for other in ranks[1:]:
            b = other[method]
            for step in range(STEPS):
                for what in ("lookahead", "w", "energy", "radius"):
                    assert torch.equal(a[what][step], b[what][step]), f"{method}, step {step}: the ranks' {what} differ"
        for out in ranks:
            calls = out[method]["collectives"]
            assert calls == [[("all_reduce", (len(a["blocks"]),), torch.float64)]] * STEPS, (method, calls)
            _check_modes(out[method], method)
        _check_lengths(a, method, "FSDP2")


@pytest.mark.heavy  # processes
def test_fsdp_trajectory_equals_one_process_on_the_unsharded_model(request):
    """The look-ahead points, and the ``w`` that ``opt.eval()`` puts in the shards (gathered whole), equal those of
    the ``reference`` backend in one process; the allocation's energies and radii too."""
    rank0 = everything(request)[0]["fsdp"]
    for method in METHODS:
        run, want = rank0[method], _fsdp_reference(method)
        _assert_same_trajectory(run, want, method)
        assert rel_err(want["w"][-1].double(), want["w"][0].double()) > 1e-3  # the run really moved


@pytest.mark.heavy  # processes: the default tier's one case loads with the modules' own state dicts
@pytest.mark.parametrize("api", APIS)
def test_fsdp_checkpoint_saved_in_eval_mode_resumes_bit_for_bit(request, api):
    ranks = [out["checkpoints"] for out in everything(request)]
    for rank, out in enumerate(ranks):
        resumed = out["eval"][api]
        assert resumed["training"] is False, "the optimizer resumes in the mode it was saved in"
        assert resumed["w"], f"rank {rank}: the model loaded is not the w saved"
        assert len(resumed["run"]["w"]) == len(out["uninterrupted"]["w"]) == STEPS - CHECKPOINT_AT
        for what in ("lookahead", "w", "energy", "radius"):
            for step, (got, want) in enumerate(zip(resumed["run"][what], out["uninterrupted"][what])):
                assert torch.equal(got, want), f"rank {rank}, step {CHECKPOINT_AT + step}: {what}"


@pytest.mark.heavy  # processes
def test_fsdp_checkpoint_saved_in_train_mode_is_refused_saying_how_to_save(request):
    """torch.distributed.checkpoint loads only the entries a fresh optimizer's state dict has, so a train-mode
    checkpoint arrives without its copy of w: refused, pointing to a checkpoint saved in eval mode."""
    for rank, out in enumerate(everything(request)):
        refused = out["checkpoints"]["train"]
        assert isinstance(refused, str), f"rank {rank}: a train-mode checkpoint loaded without its copy of w"
        assert "ValueError: state dict was saved in train mode but holds no copy of w" in refused, refused
        assert "save it in eval mode, after opt.eval()" in refused, refused


# ------------------------------------------------------------------------------ sam_step, in a single process
def test_sam_step_refuses_momentum_sam_before_the_closure_runs():
    """It runs two passes, MomentumSAM takes one: refused up front, before a forward and backward are spent."""
    model = _mlp(SEED)
    opt = _momentum_sam(model, "sam", "reference", "tensor")
    calls = []

    def closure():
        calls.append(1)
        loss = F.cross_entropy(model(torch.zeros(2, 6)), torch.zeros(2, dtype=torch.long))
        loss.backward()
        return loss

    with pytest.raises(TypeError, match=r"sam_step runs SAM's two passes; MomentumSAM takes one gradient a step"):
        sam_step(opt, model, closure)
    assert calls == [] and all(p.grad is None for p in model.parameters())
