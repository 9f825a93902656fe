"""Step schedules on two gloo processes (127.0.0.1): ``distributed.sam_step`` under DDP, plain and m-sharpness, with
``Every(2)``, ``LookSAM(2)`` and ``Adaptive``, and FSDP2 (``fully_shard``) with ``LookSAM(2)`` and ``Adaptive``.

Every rank must take the same decisions and hold bitwise the same weights: a skipped step's only pass is all-reduced
(also under m-sharpness, whose SAM steps perturb each rank with its own gradient), and ``Adaptive`` averages its
statistic over the ranks. Plain DDP and FSDP2 runs equal one process on the whole batch within the suite's per-step
float32 tolerance. All the multi-process work runs once, in one process group, and every test reads its part."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gearsam_fused import GEARSAM, Adaptive, Every, LookSAM
from gearsam_fused.distributed import sam_step

from conftest import FP32_STEP_RTOL, rel_err
from ranks import run_ranks_once

pytest.importorskip("torch.distributed.fsdp")
import test_fsdp as fsdp  # noqa: E402
from test_ddp import HP, PER_RANK, SEED, SGD, WORLD, _mlp, _same_bits, _shard, _weights  # noqa: E402

STEPS = 6
DDP_SCHEDULES = {"every2": Every(2), "looksam2": LookSAM(2, 0.5), "adaptive": Adaptive(0.0, 0.5)}
FSDP_SCHEDULES = {"looksam2": LookSAM(2, 0.5), "adaptive": Adaptive(0.0, 0.5)}
MODES = ("plain", "m-sharpness")


def _data():
    g = torch.Generator().manual_seed(11)
    n = WORLD * PER_RANK
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(STEPS)]


def _gearsam(model, schedule) -> GEARSAM:
    return GEARSAM(model.parameters(), torch.optim.SGD, model=model, partition="tensor", schedule=schedule,
                   **HP, **SGD)  # fmt: skip


def _ddp_run(rank: int, schedule, m_sharpness: bool) -> dict:
    model = _mlp(SEED + rank)
    ddp = DDP(model)
    opt = _gearsam(ddp, schedule)
    out = {"w": [], "decisions": [], "calls": [], "perturbed": []}
    for xy in _data():
        x, y = _shard(xy, rank)
        seen = []

        def closure():
            seen.append(_weights(model).clone())
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            return loss

        decided = opt.sam_step
        sam_step(opt, ddp, closure, m_sharpness=m_sharpness)
        assert decided == opt.step_statistics.sam_step
        out["decisions"].append(decided)
        out["calls"].append(len(seen))
        out["perturbed"].append(seen[1] if len(seen) == 2 else None)
        out["w"].append(_weights(model).clone())
    return out


def _single_process_ddp(schedule) -> dict:
    """One process on the whole batch: the hand-written loop."""
    model = _mlp(SEED)
    opt = _gearsam(model, schedule)
    out = {"w": [], "decisions": []}
    for x, y in _data():
        F.cross_entropy(model(x), y).backward()
        if opt.first_step(zero_grad=True):
            F.cross_entropy(model(x), y).backward()
            opt.second_step(zero_grad=True)
        opt.zero_grad()
        out["decisions"].append(opt.step_statistics.sam_step)
        out["w"].append(_weights(model).clone())
    return out


def _fsdp_optimizer(model, schedule, backend: str = "auto") -> GEARSAM:
    return GEARSAM(model, torch.optim.SGD, partition="coarse", rho=0.05, beta=0.9, backend=backend, schedule=schedule,
                   **fsdp.SGD)  # fmt: skip


def _fsdp_train(model, opt, data, driver: str) -> dict:
    out = {"w": [], "decisions": []}
    for step, (x, y) in enumerate(data):

        def loss():
            return F.cross_entropy(model(x, step), y)

        if driver == "sam_step":
            opt.zero_grad()
            sam_step(opt, model, lambda: loss().backward())
        else:
            loss().backward()
            if opt.first_step(zero_grad=True):
                loss().backward()
                opt.second_step(zero_grad=True)
        opt.zero_grad()
        out["decisions"].append(opt.step_statistics.sam_step)
        out["w"].append(torch.cat([fsdp.whole(p).reshape(-1) for p in model.parameters()]))
    return out


def _everything(rank: int) -> dict:
    out = {"ddp": {}, "fsdp": {}}
    for name, schedule in DDP_SCHEDULES.items():
        for mode in MODES:
            try:
                out["ddp"][name, mode] = _ddp_run(rank, schedule, mode == "m-sharpness")
            except ValueError as error:
                out["ddp"][name, mode] = f"ValueError: {error}"
    data = fsdp.rank_data(rank, WORLD)[:STEPS]
    for name, schedule in FSDP_SCHEDULES.items():
        for driver in ("two-pass", "sam_step"):
            model = fsdp.shard(fsdp.make_net(), fsdp.SCENARIOS["gear-sam"])
            out["fsdp"][name, driver] = _fsdp_train(model, _fsdp_optimizer(model, schedule), data, driver)
    return out


def everything() -> list[dict]:
    return run_ranks_once(_everything, world=WORLD)


def _fsdp_single_process(schedule) -> dict:
    model = fsdp.make_net()
    opt = _fsdp_optimizer(model, schedule, backend="reference")
    return _fsdp_train(model, opt, fsdp.batches(WORLD)[:STEPS], "two-pass")


# ------------------------------------------------------------------------------ DDP
DDP_CASES = [(name, mode) for name in DDP_SCHEDULES for mode in MODES if (name, mode) != ("looksam2", "m-sharpness")]


@pytest.mark.parametrize("name,mode", DDP_CASES)
def test_ddp_ranks_take_the_same_decisions_and_stay_bitwise_identical(name, mode):
    a, b = (out["ddp"][name, mode] for out in everything())
    assert a["decisions"] == b["decisions"]
    if name == "adaptive":
        assert a["decisions"][:2] == [True, True] and False in a["decisions"], a["decisions"]
    else:
        assert a["decisions"] == [s % 2 == 0 for s in range(STEPS)]
    # the closure ran twice on SAM steps, once on skipped ones
    assert a["calls"] == b["calls"] == [2 if d else 1 for d in a["decisions"]]
    for step in range(STEPS):
        assert _same_bits(a["w"][step], b["w"][step]), f"ranks differ after step {step}"
        if a["decisions"][step]:
            same = _same_bits(a["perturbed"][step], b["perturbed"][step])
            assert same == (mode == "plain"), step  # m-sharpness: each rank perturbs with its own gradient


@pytest.mark.parametrize("name", list(DDP_SCHEDULES))
def test_ddp_plain_equals_one_process_on_the_whole_batch(name):
    # here, outside the process group: Adaptive all-reduces its statistic wherever torch.distributed is initialized
    run, want = everything()[0]["ddp"][name, "plain"], _single_process_ddp(DDP_SCHEDULES[name])
    assert run["decisions"] == want["decisions"]
    for step in range(STEPS):
        assert rel_err(run["w"][step].double(), want["w"][step].double()) <= FP32_STEP_RTOL, step
    assert rel_err(want["w"][-1].double(), _weights(_mlp(SEED)).double()) > 1e-3


# ------------------------------------------------------------------------------ FSDP2
@pytest.mark.parametrize("driver", ["two-pass", "sam_step"])
@pytest.mark.parametrize("name", list(FSDP_SCHEDULES))
def test_fsdp_equals_one_process_and_ranks_hold_the_same_bits(name, driver):
    a, b = (out["fsdp"][name, driver] for out in everything())
    want = _fsdp_single_process(FSDP_SCHEDULES[name])
    assert a["decisions"] == b["decisions"] == want["decisions"]
    if name == "looksam2":
        assert a["decisions"] == [s % 2 == 0 for s in range(STEPS)]
    else:
        assert False in a["decisions"], a["decisions"]
    for step in range(STEPS):
        assert torch.equal(a["w"][step], b["w"][step]), step
        err = rel_err(a["w"][step].double(), want["w"][step].double())
        assert err <= FP32_STEP_RTOL, f"step {step}: relative error {err:.3g}"


def test_ddp_m_sharpness_with_looksam_is_refused_on_every_rank():
    """Its stored direction g_v would come from each rank's own first gradient: the skipped steps would differ."""
    for out in everything():
        refused = out["ddp"]["looksam2", "m-sharpness"]
        assert isinstance(refused, str) and refused.startswith("ValueError") and "drift apart" in refused, refused
