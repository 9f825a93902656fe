"""BatchNorm across SAM's two forward passes.

The second forward pass runs at the perturbed weights ``w + eps``; in train mode it would update the BatchNorm
running statistics a second time, with statistics of a model that is never kept. :func:`frozen_bn_stats` lets that
pass normalise with its own batch statistics (as training should) while leaving ``running_mean``, ``running_var`` and
``num_batches_tracked`` exactly as the first pass left them::

    loss_fn(model(x), y).backward()
    optimizer.first_step(zero_grad=True)
    with frozen_bn_stats(model):
        loss_fn(model(x), y).backward()
    optimizer.second_step(zero_grad=True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
