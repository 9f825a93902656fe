"""BatchNorm and sharpness-aware training: :func:`frozen_bn_stats` for SAM's second forward pass,
:func:`recompute_bn_stats` for one-pass momentum SAM's look-ahead.

SAM's second forward pass runs at the perturbed weights ``w + eps``; in train mode it would update the BatchNorm
running statistics a second time, with statistics of a model that is never kept. :func:`frozen_bn_stats` lets that
pass normalise with its own batch statistics (as training should) while leaving ``running_mean``, ``running_var`` and
``num_batches_tracked`` exactly as the first pass left them::

    loss_fn(model(x), y).backward()
    optimizer.first_step(zero_grad=True)
    with frozen_bn_stats(model):
        loss_fn(model(x), y).backward()
    optimizer.second_step(zero_grad=True)

:class:`~gearsam_fused.MomentumSAM` takes its one forward pass at the look-ahead point ``w~``, so the running
statistics describe ``w~``, not the weights ``w`` that :meth:`~gearsam_fused.MomentumSAM.eval` puts in the model for
evaluation; :func:`recompute_bn_stats` gathers them again at ``w``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from .compat import BatchNormBase, InstanceNormBase


@contextlib.contextmanager
def frozen_bn_stats(model: nn.Module) -> Iterator[list[nn.Module]]:
    """Within the block, no BatchNorm layer of ``model`` (``BatchNorm1d/2d/3d``, their lazy forms, ``SyncBatchNorm``
    and subclasses) updates its running statistics; in train mode each still normalises with the batch statistics
    (``SyncBatchNorm`` still reduces them across processes). Every layer's settings are restored on exit, also when
    the block raises. Yields the layers it froze.

    It works by clearing ``track_running_stats`` for the duration: in train mode a BatchNorm layer then passes no
    running buffers to ``batch_norm`` and does not count the batch, so the buffers are not touched at all. (Setting
    ``momentum = 0``, the usual trick, still advances ``num_batches_tracked`` and, with ``momentum=None``, the
    cumulative average.) Layers in eval mode are unaffected either way.

    Raises ``TypeError`` if ``model`` is not an ``nn.Module``, and ``ValueError`` naming the layer if ``model`` holds an
    InstanceNorm layer that tracks running statistics: those update their buffers whatever ``track_running_stats``
    says in train mode, so they cannot be frozen this way.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"frozen_bn_stats expects an nn.Module, got {type(model).__name__}")
    frozen: list[BatchNormBase] = []
    for name, module in model.named_modules():
        if isinstance(module, InstanceNormBase) and module.track_running_stats and module.training:
            raise ValueError(
                f"frozen_bn_stats cannot freeze {type(module).__name__} {name!r}: an InstanceNorm layer with "
                "track_running_stats=True updates its running statistics in train mode regardless; put it in eval "
                "mode for the second pass, or build it with track_running_stats=False"
            )
        if isinstance(module, BatchNormBase) and module.track_running_stats:
            frozen.append(module)
    try:
        for module in frozen:
            module.track_running_stats = False
        yield list(frozen)
    finally:
        # every layer collected was tracking, so this restores each one exactly, whatever happened in between
        for module in frozen:
            module.track_running_stats = True


@torch.no_grad()
def recompute_bn_stats(model: nn.Module, batches: Iterable, *, max_batches: int | None = None) -> int:
    """Recompute the running mean and variance of every BatchNorm layer of ``model`` at the weights it holds now, with
    forward passes over ``batches`` and nothing else: no gradients, no parameter changes. Returns the number of
    batches used.

    When it matters: with :class:`~gearsam_fused.MomentumSAM` every training forward pass runs at the look-ahead point
    ``w~``, so the running statistics were gathered there; after ``opt.eval()`` has put ``w`` in the model, recompute
    them at ``w`` with a few training batches before evaluating (the method's reference code spends one extra epoch on
    this)::

        opt.eval()
        recompute_bn_stats(model, train_loader, max_batches=50)
        evaluate(model)
        opt.train()   # the look-ahead point again; the recomputed statistics stay, and training updates them on

    Also after averaging weights (SWA) or any change of the weights made without forward passes.

    Each element of ``batches`` is an input (``model(x)``), an ``(input, target, ...)`` tuple or list (``model(x)``,
    the rest ignored) or a mapping of keyword inputs (``model(**batch)``); inputs are used where they are (move them
    to the model's device first, e.g. ``((x.cuda(), y) for x, y in loader)``). ``max_batches`` stops after that many.

    Every BatchNorm layer that tracks running statistics (``BatchNorm1d/2d/3d``, their lazy forms, ``SyncBatchNorm``
    and subclasses) starts afresh (``reset_running_stats``: counters at zero) and, with ``momentum=None`` for the
    duration, ends with the cumulative average over the batches of each batch's mean and unbiased variance, as
    ``torch.optim.swa_utils.update_bn`` computes them. During the passes those layers are in train mode and every other
    module in eval mode (dropout off: the statistics are those of the network as it is evaluated). Each layer's
    ``momentum`` and every module's train/eval mode are restored afterwards, also when a forward pass raises (the
    statistics are then those of the batches seen so far).

    Raises ``TypeError`` if ``model`` is not an ``nn.Module``, and ``ValueError`` if it has no BatchNorm layer that
    tracks running statistics, if ``batches`` is empty (checked before any statistic is reset) or if ``max_batches``
    is not positive.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"recompute_bn_stats expects an nn.Module, got {type(model).__name__}")
    if max_batches is not None and (type(max_batches) is not int or max_batches < 1):  # bool is not a count
        raise ValueError(f"max_batches must be a positive integer or None, got {max_batches!r}")
    layers = [m for m in model.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]
    if not layers:
        raise ValueError(
            f"recompute_bn_stats: {type(model).__name__} has no BatchNorm layer that tracks running statistics, so "
            "there is nothing to recompute"
        )
    batches = iter(batches)
    empty = object()
    first = next(batches, empty)
    if first is empty:
        raise ValueError("recompute_bn_stats needs at least one batch; the iterable given is empty")
    modes = [(m, m.training) for m in model.modules()]
    momenta = [(m, m.momentum) for m in layers]
    count = 0
    try:
        model.eval()
        for m in layers:
            m.reset_running_stats()
            m.momentum = None  # torch's cumulative average: 1 / (batches seen) per batch
            m.train()
        # islice stops before drawing a batch it would not use (a data loader's next batch costs work)
        for batch in itertools.islice(itertools.chain((first,), batches), max_batches):
            _forward(model, batch)
            count += 1
    finally:
        for m, momentum in momenta:
            m.momentum = momentum
        for m, training in modes:
            m.training = training
    return count


def _forward(model: nn.Module, batch) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(batch[0])
    else:
        model(batch)
