"""Cost of the SAM machinery itself: ``first_step`` + ``second_step`` with a base optimizer that does nothing.

Every contender of :mod:`contenders` runs in the same process on the same parameter set (:mod:`param_sets`), float32,
on CUDA when there is a GPU and on CPU otherwise; a peer that is not installed is left out, its rows saying so
(``left_out``). One test per set builds every contender, SAM's and GEAR-SAM's, each on a copy of the set of its own
(the same weights and gradients; from :data:`bench_whole_step.SHARED_FROM` parameters pytorch_optimizer's two paths,
which update the tensors in place, share one), warms each up and times them in turn within each round
(``conftest.step_in_turn``: the memory floor measured once per round, then every contender's step timed alone, the
order turned by one place each round). Per step it records:

* time: median and quartiles over the rounds (each round one synchronised step; on CUDA also the median by CUDA
  events over 50 back-to-back steps), and the step's time in each round (``round_ms``);
* its ratios to the per-tensor loop and to pytorch_optimizer's SAM (its path faster in these rounds), each the median
  of the per-round ratios with their quartiles and range (``vs``, ``vs_path``; ``rows.interleaved_fields``); a
  GEAR-SAM row, which no other implementation has, against those SAM steps of the same rounds;
* memory traffic by our count, for d parameters in float32: energy reads g (4d); perturb reads w and g and writes
  w + eps (12d, :mod:`bench_whole_step` says how); restore gives the buffers their memory back and moves nothing (0d,
  as the ``cpp`` CPU kernels do past the stream threshold; a restore that copies reads the backup and writes w, 8d):
  16d bytes, the floor for an unfused energy/perturb/restore step (24d in runs from commit 177df32 to commit 3c9b394,
  which counted the copy, and 28d before them; each row records its count). GB/s is that count over the median time,
  and ``pct_floor`` compares it with the memory floor measured in the same run (``conftest.MemoryFloor``);
* kernel launches per step (CUDA: torch profiler; not counted on CPU);
* memory the contender holds beyond parameters and gradients while perturbed, and on CUDA the allocator's peak
  increase during a step.

The SAM family (``test_family_sam_step``, one test per variant): each variant of :data:`contenders.FAMILY` (GSAM, WSAM,
F-SAM, GEAR-SAM with GSAM's descent, and SAM and GEAR-SAM as their yardsticks), ours on each backend and
pytorch_optimizer's on both its paths where it has the variant, on :data:`contenders.FAMILY_SET_KEY`, counted at 16d
plus the bytes the variant's parts move (``Variant.extra_bytes``). A variant's contenders are stepped in turn within
each round as above (``bench_whole_step.family_rounds``), together with the yardsticks their ratios need, which have no
rows of their own (``contenders.family_steps``): each contender's plain variant (SAM, or GEAR-SAM for a GEAR-SAM
variant) and, for a GEAR-SAM variant, which the peer does not have, the peer's variant under SAM's radius on both its
paths. Each row's ratios are medians of per-round ratios with their quartiles and range (``rows.family_fields``):
``vs`` (pytorch_optimizer's path faster in these rounds over this step) and ``over`` (``own SAM``: this step over its
plain variant's). Quick mode runs it on one of our backends and the peer's ``foreach`` path only.
"""

from __future__ import annotations

import gc

import pytest
import torch
from bench_whole_step import SHARED_FROM, STEP_TEMPORARIES, cuda_fields, family_rounds

from gearsam_fused.allocation import RULES, SAM_RULE

import contenders
import param_sets
from conftest import (
    DEVICE,
    ENERGY_BYTES,
    PERTURB_BYTES,
    available_memory_bytes,
    cuda_event_median_ms,
    cuda_launches,
    fit_in_memory,
    step_in_turn,
    step_rounds,
    synchronize,
    warm_up,
)
from rows import interleaved_fields

BYTES_PER_PARAM = ENERGY_BYTES + PERTURB_BYTES  # the restore: 0, an exchange of memory
NOT_INSTALLED = contenders.not_installed()  # peers shown as skipped, with the note, instead of left out
FAMILY_LR = 0.01


#: the steps left out first, in this order, where a set's contenders would not fit in memory together
#: (``conftest.fit_in_memory``): the slowest of ours, GEAR-SAM's first
LEAVE_FIRST = ("sharded, gear-sam", "reference, gear-sam", "sharded", "reference", "torch, gear-sam")
LOOP = "per-tensor loop"
#: what every row is compared with in the same rounds (SAM's steps): label -> the paths it stands for
REFERENCES = {LOOP: (LOOP,), contenders.PEER: tuple(contenders.PEER_PATHS)}


def row_key(contender: str, rule: str) -> str:
    """The name of a contender's step under ``rule`` among the set's: the contender's for SAM, with the rule for
    GEAR-SAM (``"cpp, gear-sam"``)."""
    return contender if rule == SAM_RULE else f"{contender}, {rule}"


def sam_step_contenders(device: str) -> list[tuple[str, str]]:
    """(contender, rule) of every step a set's rounds take here: SAM's, then GEAR-SAM's (our backends only)."""
    usable = contenders.available(device)
    return [(c, rule) for rule in RULES for c in usable if rule == SAM_RULE or c not in contenders.SAM_ONLY]


@pytest.mark.parametrize("set_key", param_sets.SET_KEYS)
def test_sam_step(record_rounds, quick, floor, leave_out, set_key):
    entries = [(c, rule) for c, rule in sam_step_contenders(DEVICE) if c not in leave_out]
    gc.collect()
    available = available_memory_bytes()
    first = param_sets.build(set_key, DEVICE, quick)
    shared = first if first.numel >= SHARED_FROM else None

    def held_buffers(key: str) -> int:  # its copy of the set (none where it shares one), its backup; sharded: copies
        copy = 0 if shared is not None and key in contenders.PEER_PATHS else 2
        return copy + (3 if key.startswith("sharded") else 1)

    kept, too_many = fit_in_memory([row_key(*e) for e in entries], held_buffers, 4 * first.numel, LEAVE_FIRST,
                                   available, STEP_TEMPORARIES + (2 if shared is not None else 0))  # fmt: skip
    entries = [e for e in entries if row_key(*e) in kept]
    unused = [first] if shared is None else []
    optimizers, steps = {}, {}
    for contender, rule in entries:
        key = row_key(contender, rule)
        if shared is not None and contender in contenders.PEER_PATHS:
            params = shared  # updated in place, kept where they are
        else:
            params = unused.pop() if unused else param_sets.build(set_key, DEVICE, quick)
        optimizers[key] = opt = contenders.make(contender, rule, params.model, params.partition)

        def step(opt=opt):
            opt.first_step()
            opt.second_step()

        def synchronised(step=step):
            step()
            synchronize()

        steps[key] = synchronised
        steps[key].unsynchronised = step
    extra = {}
    for (contender, _rule), key in zip(entries, steps):
        warm_up(steps[key])  # kernel compilation, allocator, re-homing of the gradients
        opt = optimizers[key]
        opt.first_step()
        extra[key] = {"held_bytes": contenders.held_bytes(contender, opt)}
        opt.second_step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            steps[key]()
            extra[key].update(peak_extra_bytes=torch.cuda.max_memory_allocated() - before,
                              launches=cuda_launches(steps[key].unsynchronised),
                              cuda_event_median_ms=cuda_event_median_ms(steps[key].unsynchronised))  # fmt: skip
    rounds = step_rounds(first.numel, quick)
    seconds, samples = step_in_turn(steps, rounds, floor)
    ratios = interleaved_fields({key: [1e3 * t for t in seconds[key]] for key in steps}, REFERENCES)
    counted, read_only = BYTES_PER_PARAM * first.numel, ENERGY_BYTES * first.numel
    for contender, rule in entries:
        key = row_key(contender, rule)
        record_rounds(
            seconds[key], set=first.name, rule=rule, contender=contender, parameters=first.numel,
            tensors=len(first.params), bytes_counted=counted, stepped_in_turn=list(steps), left_out={**NOT_INSTALLED, **leave_out, **too_many},
            shared_copy=shared is not None and contender in contenders.PEER_PATHS, **ratios[key], **extra[key],
            **floor.fields(counted, seconds[key], first.numel, key, read_only, samples),
        )  # fmt: skip


@pytest.mark.parametrize("variant", list(contenders.FAMILY))
def test_family_sam_step(record_rounds, quick, floor, leave_out, variant):
    plan = contenders.family_steps(variant, DEVICE, quick, leave_out)

    def build(name: str, contender: str, params: param_sets.ParamSet):
        # lr: WSAM's decoupled step reads it from the param groups, after the base optimizer's (here empty) update
        return contenders.make_variant(name, contender, params.model, params.partition, lr=FAMILY_LR)

    done = family_rounds(plan, quick, floor, build)
    v, numel = contenders.FAMILY[variant], done.params.numel
    counted = (BYTES_PER_PARAM + v.extra_bytes) * numel
    read_only = (ENERGY_BYTES + v.read_only_bytes) * numel
    for contender in plan.rows:
        record_rounds(
            done.seconds[contender], set=done.params.name, variant=variant, rule=v.rule, peer_variant=v.peer,
            plain_variant=v.plain, contender=contender, parameters=numel, tensors=len(done.params.params),
            bytes_counted=counted, **done.fields(contender), **memory_held(contender, done.optimizers[contender]),
            **floor.fields(counted, done.seconds[contender], numel, contender, read_only, done.samples),
        )  # fmt: skip


def memory_held(contender: str, opt) -> dict:
    """What ``opt`` holds beyond parameters and gradients while perturbed (``held_bytes``); on CUDA also the
    allocator's peak increase during a step, the kernels a step launches and its median by CUDA events."""
    opt.first_step()
    fields = {"held_bytes": contenders.held_bytes(contender, opt)}
    opt.second_step()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.first_step()
        opt.second_step()
        torch.cuda.synchronize()
        fields["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
    return {**fields, **cuda_fields(opt)}
