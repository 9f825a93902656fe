"""End-to-end training step of a CIFAR ResNet-18 on synthetic data, and what SAM adds to it.

Contenders, each a whole step (forward, backward, optimizer) on the same model, batch and base optimizer (torch's SGD
with momentum and weight decay, ``foreach=True``, the path torch takes by default; on a GPU its ``fused=True`` step is
the faster one, which :mod:`bench_models` times beside it):

* ``SGD``                  one forward/backward pass and the SGD step: what SAM is compared against
* ``per-tensor loop SAM``  :class:`contenders.PerTensorLoopSAM` with SGD
* ``pytorch_optimizer``    ``pytorch_optimizer.SAM(..., foreach=True)`` with SGD (skipped with a note when it is not
  installed)
* ``compiled foreach SAM``, ``compiled foreach GEAR-SAM``  :class:`contenders.CompiledForeachSAM` with SGD (GEAR-SAM
  over the ``"coarse"`` blocks ours use, beta 0.9): forward and backward eager, the perturbation and SGD's step each
  under ``torch.compile``; the row records ``compile_s``, the seconds of the warm-up's calls that compiled
* ``SAM``, ``GEAR-SAM``    gearsam_fused, ``backend="auto"``, ``zero_grad(set_to_none=False)``; the SGD step runs fused
  into the restore where the backend can (the row's ``base_step_mode`` says which path ran)
* ``MomentumSAM``          :class:`gearsam_fused.MomentumSAM` with SGD, ``backend="auto"``: one forward+backward
  per step, at the look-ahead point, then ``step()`` (the SGD step fused with the restore, then the look-ahead),
  ``zero_grad(set_to_none=False)``, stepping as the ``SGD`` row does
* ``SAM every-5``, ``GEAR-SAM LookSAM-5``, ...  the same under a schedule (:data:`SCHEDULES`: ``Every(5)``,
  ``LookSAM(5)``, ``Every(2)``, ``Adaptive()``), stepping by the public protocol: ``loss.backward()``, then
  ``if opt.first_step(zero_grad=True):`` the second forward+backward and ``opt.second_step(zero_grad=True)``. A round
  is a whole cycle (k steps, its SAM step first: k first passes and one second pass; the round fails otherwise), or
  10 steps under ``Adaptive``, whose second passes are counted; the row's numbers are per training step

Three more rows time parts alone: ``forward+backward``, the ``base step`` (SGD's ``step()``) and ``SGD``. The SAM
rows do not subtract those medians, which come from other moments of the run: every round of a SAM row times, back to
back on the same input, one forward+backward pass (on the contender's own model), one whole SGD step (on a copy of the
model) and then the SAM step, and from each round

    beyond 2 x (forward+backward) = SAM step - 2 x (forward+backward)
    SAM tax                       = SAM step - SGD step - (forward+backward)

and for a schedule's round of k steps with p second passes, per training step: step = round / k, beyond = (round -
(k + p) x (forward+backward)) / k, tax = (round - k x SGD step - p x (forward+backward)) / k. Every SAM row also
records its step over the same round's SGD step (``over_sgd``, median and quartiles).

Each round of the ``MomentumSAM`` row also times, after that SGD step, one step of full SAM (``SAM``, as its row
builds it) on a third copy of the model: ``over_sgd`` is MomentumSAM's step over the SGD step of the same round,
``sam_over_sgd`` SAM's over the same SGD step, and ``over_paired_sam`` MomentumSAM's over that SAM step (each the
median and quartiles over the rounds). With one pass per step its ``beyond`` is step - (forward+backward) and its
tax step - SGD step.

``beyond`` is everything in a SAM step that is not one of its two passes: the gradient norm, perturbation and restore,
the base optimizer's update (fused into the restore for ours, torch's ``foreach`` step for the others) and two
``zero_grad``. The tax is what a SAM step costs beyond a plain SGD step and the second pass: ``beyond`` minus SGD's own
update and ``zero_grad``. A row records the median and quartiles of both over its rounds.

Batch 128 at full width on CUDA (bf16 autocast, channels_last); on CPU the network is narrower (width 16) and the
batch 32, so a run stays within minutes; quick mode shrinks both further.
"""

from __future__ import annotations

import contextlib
import copy
import time

import pytest
import torch
import torch.nn.functional as F

from gearsam_fused import GEARSAM, SAM, Adaptive, Every, LookSAM, MomentumSAM, partition
from gearsam_fused.models import resnet18

import contenders
from conftest import DEVICE, synchronize, warm_up
from report import quartiles, sam_parts

SGD_KW = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "foreach": True}
PARTS = ["forward+backward", "base step", "SGD"]
#: rows under a schedule: name -> (schedule, steps per round); a round of Every / LookSAM is one whole cycle
SCHEDULES = {"every-5": (Every(5), 5), "LookSAM-5": (LookSAM(5), 5), "every-2": (Every(2), 2),
             "adaptive": (Adaptive(), 10)}  # fmt: skip
SCHEDULE_ROWS = [f"{rule} {schedule}" for schedule in SCHEDULES for rule in ("SAM", "GEAR-SAM")]
COMPILED_ROWS = {contenders.COMPILED: "sam", contenders.COMPILED_GEAR: "gear-sam"}  # name -> rule
MOMENTUM_SAM = "MomentumSAM"  # one forward+backward per step: the SGD step's protocol
SAM_ROWS = ["per-tensor loop SAM", "pytorch_optimizer", *COMPILED_ROWS, "SAM", "GEAR-SAM", MOMENTUM_SAM,
            *SCHEDULE_ROWS]  # fmt: skip
ROWS = PARTS + SAM_ROWS


def _setting(quick: bool) -> dict:
    if DEVICE == "cuda":
        return {"width": 64, "batch": 128, "channels_last": True, "autocast": torch.bfloat16}
    return {"width": 8 if quick else 16, "batch": 8 if quick else 32, "channels_last": False, "autocast": None}


def _problem(quick: bool):
    s = _setting(quick)
    torch.manual_seed(0)
    model = resnet18(num_classes=10, width=s["width"]).to(DEVICE)
    x = torch.randn(s["batch"], 3, 32, 32, device=DEVICE)
    y = torch.randint(0, 10, (s["batch"],), device=DEVICE)
    if s["channels_last"]:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    autocast = torch.autocast(DEVICE, dtype=s["autocast"]) if s["autocast"] is not None else contextlib.nullcontext()
    return s, model, x, y, autocast


def _step_function(name: str, model, x, y, autocast):
    def forward_backward():
        with autocast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()

    if name == "forward+backward":
        return forward_backward
    sgd = torch.optim.SGD(model.parameters(), **SGD_KW) if name in ("base step", "SGD") else None
    if name == "base step":
        forward_backward()  # momentum buffers and gradients exist; the step alone is timed
        return sgd.step
    if name == "SGD":

        def step():
            sgd.zero_grad(set_to_none=False)
            forward_backward()
            sgd.step()

        return step
    if name == "per-tensor loop SAM":
        opt = contenders.PerTensorLoopSAM(model.parameters(), lambda params: torch.optim.SGD(params, **SGD_KW))
        holder = model  # the loop keeps no gradient buffers: the model's own gradients are zeroed
    elif name == "pytorch_optimizer":
        import pytorch_optimizer as peer

        opt = holder = peer.SAM(model.parameters(), torch.optim.SGD, rho=0.05, **SGD_KW)  # foreach=True: its SAM too
    elif name in COMPILED_ROWS:
        blocks = [block.params for block in partition(model, "coarse")]  # GEARSAM's default blocks (SAM: one scale)
        sgd_kw = {k: v for k, v in SGD_KW.items() if k != "foreach"}  # the contender builds SGD with foreach=True
        opt = contenders.CompiledForeachSAM(blocks, torch.optim.SGD, rho=0.05, rule=COMPILED_ROWS[name], **sgd_kw)
        holder = model
    elif name in SCHEDULE_ROWS:
        return _schedule_round(name, model, forward_backward)
    elif name == MOMENTUM_SAM:
        opt = MomentumSAM(model, torch.optim.SGD, rho=1.0, **SGD_KW)  # the efficiency study's radius

        def one_pass_step():
            opt.zero_grad(set_to_none=False)
            forward_backward()
            opt.step()

        one_pass_step.optimizer = opt
        return one_pass_step
    else:
        cls = SAM if name == "SAM" else GEARSAM
        opt = holder = cls(model, torch.optim.SGD, rho=0.05, **SGD_KW)

    return contenders.two_pass_step(opt, holder, forward_backward)


def _schedule_round(name: str, model, forward_backward):
    """One round of a schedule row: ``steps`` training steps by the public protocol, which runs the second pass only
    when ``first_step`` returns True. Under Every and LookSAM a round is one whole cycle, its SAM step first (the
    round fails otherwise); under Adaptive the SAM steps of each round are counted."""
    rule, _, key = name.partition(" ")
    schedule, steps = SCHEDULES[key]
    opt = (SAM if rule == "SAM" else GEARSAM)(model, torch.optim.SGD, rho=0.05, schedule=schedule, **SGD_KW)
    cycle = isinstance(schedule, Every)  # LookSAM is one too
    second_passes: list[int] = []

    def sam_round():
        taken = []
        for _ in range(steps):
            forward_backward()
            sam = opt.first_step(zero_grad=True)
            if sam:
                forward_backward()
                opt.second_step(zero_grad=True)
            taken.append(sam)
        if cycle and taken != [True] + [False] * (steps - 1):
            raise AssertionError(f"{name}: a round must be one cycle, its SAM step first; took {taken}")
        second_passes.append(sum(taken))

    sam_round.optimizer = opt
    sam_round.steps = steps
    sam_round.second_passes = second_passes
    return sam_round


def _ratio_fields(name: str, ratios: list[float]) -> dict[str, float]:
    """``name`` and ``name_q1``/``name_q3``: the median and quartiles of per-round ``ratios``."""
    q1, median, q3 = quartiles(ratios)
    return {name: median, f"{name}_q1": q1, f"{name}_q3": q3}


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    synchronize()
    return time.perf_counter() - start


@pytest.mark.parametrize("name", ROWS)
def test_train_step(benchmark, record, quick, name):
    missing = contenders.not_installed()
    if name in missing:
        pytest.skip(missing[name])
    setting, model, x, y, autocast = _problem(quick)
    reference = copy.deepcopy(model)  # the SGD step of each round trains a copy, leaving the contender's model alone
    step = _step_function(name, model, x, y, autocast)

    def synchronised_step():
        step()
        synchronize()

    steps = getattr(step, "steps", 1)  # training steps per round
    # a schedule's round is several steps: in quick mode (a smoke run) one round warms it up
    warm_up(synchronised_step, min_steps=1, min_seconds=0.0) if quick and steps > 1 else warm_up(synchronised_step)
    compiled = getattr(getattr(step, "optimizer", None), "compile_s", None)  # the warm-up's compiling calls
    passes = getattr(step, "second_passes", None)
    if passes is not None:
        passes.clear()  # the warm-up's rounds are not counted
    extra, parts = {}, {"forward+backward": [], "SGD": [], "SAM": []}
    setup = None
    if name in SAM_ROWS:
        own_pass = _step_function("forward+backward", model, x, y, autocast)
        sgd_step = _step_function("SGD", reference, x, y, autocast)
        warm_up(sgd_step)
        # MomentumSAM's rounds also time full SAM, on a copy of its own, for both ratios to the same SGD steps
        sam_step = _step_function("SAM", copy.deepcopy(reference), x, y, autocast) if name == MOMENTUM_SAM else None
        if sam_step is not None:
            warm_up(sam_step)

        def setup():  # not timed by the benchmark: the parts of this round, just before its SAM step
            parts["forward+backward"].append(_timed(own_pass))
            parts["SGD"].append(_timed(sgd_step))
            if sam_step is not None:
                parts["SAM"].append(_timed(sam_step))
            if passes is not None:  # the protocol's first backward finds no gradient, as after zero_grad=True
                model.zero_grad(set_to_none=True)
            return (), {}

        if hasattr(step.optimizer, "base_step_mode"):  # ours: whether the SGD step ran fused into the restore
            extra["base_step_mode"] = step.optimizer.base_step_mode
    benchmark.group = f"train step, CIFAR ResNet-18 width {setting['width']}, batch {setting['batch']}, {DEVICE}"
    rounds = 3 if quick else (30 if DEVICE == "cuda" else 40)
    if steps > 1:
        rounds = 2 if quick else max(20, rounds * 2 // steps)  # at least 80 (CPU) training steps per row
    benchmark.pedantic(synchronised_step, setup=setup, rounds=rounds, iterations=1)
    if compiled is not None:
        assert step.optimizer.compile_s == compiled, f"{name} compiled again while it was timed"
        cache = step.optimizer.compile_cache
        extra.update(compile_s=compiled, compile_cache_hits=cache["hits"], compile_cache_misses=cache["misses"])
    if name in SAM_ROWS:
        cycle = {} if passes is None else {"steps": [steps] * len(passes), "second_passes": passes}
        round_s = benchmark.stats.stats.data
        if name == MOMENTUM_SAM:  # one step and no second pass per round
            cycle = {"steps": [1] * len(round_s), "second_passes": [0] * len(round_s)}
            sam_s, sgd_s = parts["SAM"], parts["SGD"]
            extra.update(_ratio_fields("sam_over_sgd", [a / b for a, b in zip(sam_s, sgd_s, strict=True)]))
            extra.update(_ratio_fields("over_paired_sam", [a / b for a, b in zip(round_s, sam_s, strict=True)]))
            extra.update(paired_sam_ms=1e3 * quartiles(sam_s)[1], one_pass=True)
        extra.update(sam_parts(round_s, parts["forward+backward"], parts["SGD"], **cycle))
    if passes is not None:
        extra.update(schedule=repr(step.optimizer.schedule), steps_per_round=steps,
                     sam_fraction=sum(passes) / (steps * len(passes)))  # fmt: skip
    fields = dict(contender=name, **{k: str(v) if k == "autocast" else v for k, v in setting.items()}, **extra)
    benchmark.extra_info.update(fields)
    record(**fields)
