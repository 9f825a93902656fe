"""SAM and GEAR-SAM under ``torch.nn.parallel.DistributedDataParallel`` (DDP), including m-sharpness.

Plain data-parallel SAM needs nothing beyond the usual loop: both forward/backward passes run through the DDP module,
so both gradients are all-reduced, every rank computes the same perturbation and the same update, and the ranks stay
identical. :func:`sam_step` runs that loop for you.

m-sharpness (Foret et al., 2021, Sec. 4.1): each rank perturbs its weights with the gradient of its *own* mini-batch
and only the gradient at the perturbed point is averaged. Two details make this easy to get wrong by hand:

* DDP decides at *forward* time whether the following backward all-reduces, so the first forward and its backward
  must both run inside ``model.no_sync()``;
* gradients accumulated under ``no_sync()`` are all-reduced by the next synchronised backward together with the new
  ones, so they must be cleared between the passes.

``sam_step(..., m_sharpness=True)`` does both. With GEAR-SAM each rank then also keeps its own EMA of block energies
(it allocates its own perturbation), so ``state_dict()`` saved on one rank holds that rank's EMA; the weights and the
base optimizer's state stay identical on every rank.

Under a ``schedule`` (:mod:`gearsam_fused.schedules`) a step the schedule skips runs the first pass only, all-reduced
even with m-sharpness (the base optimizer's update is made with that gradient, which must be the same on every rank),
and ``first_step`` makes the update. Every rank takes the same decisions: :class:`~gearsam_fused.schedules.Every`,
``LookSAM`` and ``Random`` (with one seed) decide from the step count, ``Adaptive`` from a statistic averaged over
the ranks.

:class:`~gearsam_fused.MomentumSAM` takes one gradient a step, at the look-ahead point the parameters hold, so it
needs no helper: ``loss.backward()`` through the DDP module all-reduces that gradient, and every rank then computes the
same update and the same look-ahead point (``sam_step`` refuses it). On a ``fully_shard`` (FSDP2) model its momentum's
block energies are summed over the ranks, as SAM's are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .optim import SharpnessAware, check_sharpness_aware

__all__ = ["sam_step"]


def _is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a module ``fully_shard`` (FSDP2) has sharded: it reduces gradients itself."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6, or a build without distributed support
        return False
    return isinstance(model, FSDPModule)


def _multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_step(optimizer: SharpnessAware, model: nn.Module, closure, m_sharpness: bool) -> bool:
    """Refuse what :func:`sam_step` cannot do right, each by name; returns whether ``model`` is a DDP module."""
    check_sharpness_aware(optimizer)
    if optimizer.one_pass:
        # refused before the closure runs: its forward and backward would be spent, and its gradient left behind
        raise TypeError(
            f"sam_step runs SAM's two passes; {type(optimizer).__name__} takes one gradient a step: call "
            "loss.backward() through the DDP or fully_shard model, then optimizer.step(), which needs nothing more "
            "on several processes"
        )
    if not callable(closure):
        raise TypeError(
            f"closure must be callable (forward + backward, returning the loss), got {type(closure).__name__}"
        )
    if not isinstance(m_sharpness, bool):
        raise TypeError(f"m_sharpness must be a bool, got {m_sharpness!r}")
    wrapped = isinstance(model, DistributedDataParallel)
    sharded = _is_fully_sharded(model)
    if not wrapped and not sharded and _multi_process():
        # Without DDP's (or FSDP2's) hooks neither pass would be reduced and the ranks would drift apart silently.
        raise TypeError(
            f"model must be the DistributedDataParallel or fully_shard (FSDP2) module that closure runs forward "
            f"through, got {type(model).__name__} while {dist.get_world_size()} processes are training"
        )
    if m_sharpness and sharded:
        raise ValueError(
            "m_sharpness is not supported on a fully_shard (FSDP2) model: each rank only holds shards of the "
            "parameters, so a perturbation from its own mini-batch's gradient would need that whole gradient on "
            "every rank; use DistributedDataParallel for m-sharpness"
        )
    if m_sharpness and wrapped and model.static_graph:
        # DDP's static graph asserts inside backward under no_sync() (pytorch/pytorch#143580): refuse up front
        raise ValueError(
            "m_sharpness runs the first pass under DDP's no_sync(), which DistributedDataParallel(static_graph=True) "
            "does not support; build the DDP module with static_graph=False"
        )
    schedule = getattr(optimizer, "schedule", None)
    if m_sharpness and wrapped and schedule is not None and schedule.corrects and _multi_process():
        # LookSAM keeps g_v = g_s - proj_g(g_s) from a SAM step and adds it on the skipped ones: with m-sharpness g is
        # each rank's own gradient, so g_v, and with it every skipped step's update, would differ between the ranks
        raise ValueError(
            f"m_sharpness with schedule {schedule!r} would make the ranks drift apart: LookSAM's stored direction is "
            "computed from the first gradient, which m-sharpness leaves unreduced, so each rank would correct its "
            "skipped steps differently; use m_sharpness=False, or a schedule without correction (Every, Random, "
            "Adaptive)"
        )
    return wrapped


def sam_step(
    optimizer: SharpnessAware,
    model: nn.Module,
    closure: Callable[[], torch.Tensor],
    *,
    m_sharpness: bool = False,
    set_to_none: bool = True,
) -> torch.Tensor:
    """One full SAM / GEAR-SAM step; returns the first pass's loss (the loss at the unperturbed weights).

    ``closure`` runs the forward pass through ``model`` and calls ``backward()`` on the loss it returns; it is called
    twice, at ``w`` and at ``w + eps``, and must not zero gradients itself. The step is::

        optimizer.zero_grad(set_to_none)
        closure()                               # inside model.no_sync() when m_sharpness
        optimizer.first_step(cancellable=True)  # w -> w + eps
        optimizer.zero_grad(set_to_none)
        closure()                               # all-reduced by DDP; if it raises, the step is cancelled
        optimizer.second_step()                 # restore w, base optimizer step

    On a step the optimizer's ``schedule`` skips (``optimizer.sam_step`` False, read before the first pass) the
    closure is called once, at ``w`` and all-reduced also with ``m_sharpness``, and ``first_step`` makes the base
    optimizer's update with that gradient; the gradients are left as that pass made them.

    Args:
        optimizer: a :class:`~gearsam_fused.SAM` or :class:`~gearsam_fused.GEARSAM`.
        model: the ``DistributedDataParallel`` module the closure calls, or a model sharded by ``fully_shard``
            (FSDP2; plain SAM only). In a single process (no process group, or world size 1) any module is accepted
            and both modes are plain SAM.
        m_sharpness: perturb each rank with its local gradient (first pass not all-reduced); the update still uses
            the all-reduced gradient at the perturbed points, so the ranks stay identical. Not available with
            ``DistributedDataParallel(static_graph=True)``, which fails under ``no_sync()``, nor with a
            :class:`~gearsam_fused.schedules.LookSAM` schedule on several processes (its stored direction would come
            from each rank's own first gradient, and the ranks' skipped steps would differ).
        set_to_none: how gradients are cleared before each pass (``False`` suits the fused backends, whose gradients
            then stay views of their flat buffers).

    On return the gradients hold the (all-reduced) gradient at the perturbed point (on a skipped step, at ``w``).
    """
    wrapped = _check_step(optimizer, model, closure, m_sharpness)
    # decided before the first forward: a skipped step's only pass feeds the update, so it is always all-reduced
    perturbs = optimizer.sam_step
    local_first_pass = model.no_sync() if (m_sharpness and wrapped and perturbs) else contextlib.nullcontext()

    optimizer.zero_grad(set_to_none=set_to_none)
    with torch.enable_grad(), local_first_pass:
        loss = closure()
    if not optimizer.first_step(cancellable=True):
        return loss  # the schedule skipped this step's second pass: first_step made the update
    optimizer.zero_grad(set_to_none=set_to_none)
    with optimizer.cancel_on_error(), torch.enable_grad():
        closure()
    optimizer.second_step()
    return loss
