"""Cost of the SAM machinery itself: ``first_step`` + ``second_step`` with a base optimizer that does nothing.

Every contender of :mod:`contenders` runs in the same process on the same parameter set (:mod:`param_sets`), float32,
on CUDA when there is a GPU and on CPU otherwise; a peer that is not installed is skipped with a note saying so. Per
step it records:

* time: median and quartiles over the rounds (each round one synchronised step; on CUDA also the median by CUDA
  events over 50 back-to-back steps);
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

import pytest
import torch

from gearsam_fused.allocation import RULES, SAM_RULE

import contenders
import param_sets
from conftest import (
    DEVICE,
    ENERGY_BYTES,
    PERTURB_BYTES,
    PairedRounds,
    cuda_event_median_ms,
    cuda_launches,
    sam_step_of,
    step_rounds,
    synchronize,
    warm_up,
)

BYTES_PER_PARAM = ENERGY_BYTES + PERTURB_BYTES  # the restore: 0, an exchange of memory
NOT_INSTALLED = contenders.not_installed()  # peers shown as skipped, with the note, instead of left out
FAMILY_LR = 0.01


# the set varies slowest: the contenders of a set run one after the other, minutes apart from the other sets
@pytest.mark.parametrize("contender", contenders.available(DEVICE) + list(NOT_INSTALLED))
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("set_key", param_sets.SET_KEYS)
def test_sam_step(benchmark, record, quick, floor, contender, rule, set_key):
    if contender in NOT_INSTALLED:
        pytest.skip(NOT_INSTALLED[contender])
    if rule != SAM_RULE and contender in contenders.SAM_ONLY:
        pytest.skip(f"{contender} implements SAM only")
    params = param_sets.build(set_key, DEVICE, quick)
    opt = contenders.make(contender, rule, params.model, params.partition)
    measure(benchmark, record, quick, floor, params, opt, contender, rule=rule)


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
