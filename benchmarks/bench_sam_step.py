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

The SAM family (``test_family_sam_step``): each variant of :data:`contenders.FAMILY` (GSAM, WSAM, F-SAM, GEAR-SAM with
GSAM's descent, and SAM and GEAR-SAM as their yardsticks), ours on each backend and pytorch_optimizer's where it has
it, on :data:`contenders.FAMILY_SET_KEY`, counted at 16d plus the bytes the variant's parts move
(``Variant.extra_bytes``). Quick mode runs it on one of our backends and the peer's ``foreach`` path only. Each round
of one of our variants also times, just before it, one step of our plain SAM (GEAR-SAM for a GEAR-SAM variant) on a
second copy of the set: ``over_paired_plain`` (median, quartiles over the rounds) is the variant's cost over SAM's at
the same moment, which the ratio of two rows' medians, minutes apart on a shared machine, is not.
"""

from __future__ import annotations

import gc

import pytest
import torch
from bench_whole_step import SHARED_FROM, STEP_TEMPORARIES

from gearsam_fused.allocation import RULES, SAM_RULE

import contenders
import param_sets
from conftest import (
    DEVICE,
    ENERGY_BYTES,
    PERTURB_BYTES,
    PairedRounds,
    available_memory_bytes,
    cuda_event_median_ms,
    cuda_launches,
    fit_in_memory,
    sam_step_of,
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


@pytest.mark.parametrize("contender", contenders.variant_contenders(DEVICE) + list(NOT_INSTALLED))
@pytest.mark.parametrize("variant", list(contenders.FAMILY))
def test_family_sam_step(benchmark, record, quick, floor, variant, contender):
    if contender in NOT_INSTALLED:
        pytest.skip(NOT_INSTALLED[contender])
    if reason := contenders.family_skip(variant, contender, DEVICE, quick):
        pytest.skip(reason)
    params = param_sets.build(contenders.FAMILY_SET_KEY, DEVICE, quick)
    # lr: WSAM's decoupled step reads it from the param groups, after the base optimizer's (here empty) update
    opt = contenders.make_variant(variant, contender, params.model, params.partition, lr=FAMILY_LR)
    v = contenders.FAMILY[variant]
    plain = None
    if contender not in contenders.PEER_PATHS and variant != v.plain:  # ours: paired with our plain SAM, on a copy
        twin = param_sets.build(contenders.FAMILY_SET_KEY, DEVICE, quick, seed=1)
        plain = contenders.make_variant(v.plain, contender, twin.model, twin.partition, lr=FAMILY_LR)
    measure(benchmark, record, quick, floor, params, opt, contender, extra_bytes=v.extra_bytes,
            read_only_bytes=v.read_only_bytes, paired=plain, rule=v.rule,
            variant=variant, peer_variant=v.peer, plain_variant=v.plain)  # fmt: skip


def measure(benchmark, record, quick, floor, params, opt, contender: str, extra_bytes: int = 0,
            read_only_bytes: int = 0, paired=None, **fields):  # fmt: skip
    """Time ``opt``'s ``first_step`` + ``second_step`` over ``params`` and record the row, with ``fields``; its
    counted bytes are SAM's plus ``extra_bytes`` per parameter, ``read_only_bytes`` of those in passes that only read
    (as SAM's energy pass). ``paired``: an optimizer over a copy of the set whose step is timed just before each
    round (not in the row's time), recorded as ``paired_plain_ms`` and ``over_paired_plain`` (with its quartiles)."""

    def step():
        opt.first_step()
        opt.second_step()

    def synchronised_step():
        step()
        synchronize()

    warm_up(synchronised_step)  # kernel compilation, allocator, re-homing of the gradients
    rounds_of_plain = None if paired is None else PairedRounds(sam_step_of(paired))
    opt.first_step()
    held = contenders.held_bytes(contender, opt)
    opt.second_step()
    extra = {}
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        synchronised_step()
        extra = {
            "peak_extra_bytes": torch.cuda.max_memory_allocated() - before,
            "launches": cuda_launches(step),
            "cuda_event_median_ms": cuda_event_median_ms(step),
        }
    benchmark.group = f"{fields.get('variant', fields['rule'])} step, {params.name}, {DEVICE}"
    rounds = step_rounds(params.numel, quick)
    setup = None if rounds_of_plain is None else rounds_of_plain.setup
    benchmark.pedantic(synchronised_step, setup=floor.interleaved(setup), rounds=rounds, iterations=1)
    if rounds_of_plain is not None:
        extra.update(rounds_of_plain.fields(benchmark.stats.stats.data, "plain"))
    counted = (BYTES_PER_PARAM + extra_bytes) * params.numel
    fields = dict(
        set=params.name, **fields, contender=contender, parameters=params.numel, tensors=len(params.params),
        bytes_counted=counted,
        **floor.fields(counted, benchmark.stats.stats.data, params.numel, contender,
                       (ENERGY_BYTES + read_only_bytes) * params.numel),
        held_bytes=held, **extra,
    )  # fmt: skip
    benchmark.extra_info.update(fields)
    record(**fields)
