"""Every private torch internal the package touches, in one place.

Each entry says what it is for and which torch releases it was checked on (2.11 with CUDA, 2.13 on CPU), and
``tests/library/test_compat.py`` checks each one against the installed torch, so that a torch release which changes one fails
there, by name, rather than somewhere inside a step. Nothing else in the package reaches into torch's private names.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import NoReturn

import torch
from torch.amp.grad_scaler import OptState  # GradScaler's per-optimizer stage: READY, UNSCALED, STEPPED
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.optim import optimizer as _optimizer

try:  # torch >= 2.4: the public module; torch.distributed may also be missing altogether
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - depends on the torch build
    try:
        from torch.distributed._tensor import DTensor, Shard  # torch 2.3
    except ImportError:
        DTensor = Shard = None

__all__ = [
    "DTensor", "Shard", "BatchNormBase", "InstanceNormBase", "OptState", "scaler_records", "optimizer_record", "drop_optimizer_record",
    "unscale_", "mark_stepped", "step_pre_hooks", "step_post_hooks", "graph_may_break", "graph_break", "raise_refusal",
]  # fmt: skip

#: The base class of every norm layer with running statistics in the batch dimension (BatchNorm1d/2d/3d, their lazy
#: forms, SyncBatchNorm): ``bn.frozen_bn_stats`` freezes their statistics during the second pass.
BatchNormBase = _BatchNorm
#: The base class of the InstanceNorm layers, which may track running statistics too.
InstanceNormBase = _InstanceNorm


def scaler_records(scaler: torch.amp.GradScaler) -> dict | None:
    """GradScaler's per-optimizer records (``_per_optimizer_states``: ``id(optimizer)`` -> a dict with ``"stage"``
    and ``"found_inf_per_device"``), None where this torch keeps none: ``SAMScaler`` unscales two passes through them."""
    records = getattr(scaler, "_per_optimizer_states", None)
    return records if isinstance(records, dict) else None


def optimizer_record(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict:
    """The scaler's record of ``optimizer`` (made on first access, as GradScaler's defaultdict makes it)."""
    return scaler._per_optimizer_states[id(optimizer)]


def drop_optimizer_record(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Forget the scaler's record of ``optimizer``: the next unscale starts from a fresh one."""
    del scaler._per_optimizer_states[id(optimizer)]


def unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's unscale kernel: ``grads *= inv_scale`` in place, ``found_inf`` set to 1 where one is not finite."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's LR schedulers that ``optimizer`` stepped (``_opt_called``, which ``step()`` sets and a scheduler
    reads to warn about a ``scheduler.step()`` before any ``optimizer.step()``)."""
    optimizer._opt_called = True


def step_pre_hooks(optimizer: torch.optim.Optimizer) -> Iterator:
    """The hooks torch calls before ``optimizer.step()``, in its order: the global ones, then the optimizer's."""
    return chain(_optimizer._global_optimizer_pre_hooks.values(), optimizer._optimizer_step_pre_hooks.values())


def step_post_hooks(optimizer: torch.optim.Optimizer) -> Iterator:
    """The hooks torch calls after ``optimizer.step()``, in its order: the optimizer's, then the global ones."""
    return chain(optimizer._optimizer_step_post_hooks.values(), _optimizer._global_optimizer_post_hooks.values())


@torch._dynamo.assume_constant_result
def graph_may_break() -> bool:
    """Whether the code being compiled may break into several graphs (``fullgraph=False``), read when it is traced.
    False when it cannot be told (a torch without the attributes read here): then nothing breaks the graph, and a
    graph that AOT autograd cannot take fails loudly."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # not tracing (eager), or a torch without these attributes
        return False
    return getattr(tx, "one_graph", True) is False


def graph_break() -> None:
    """End the graph being traced here (``torch._dynamo.graph_break``)."""
    torch._dynamo.graph_break()


def raise_refusal(message: str) -> NoReturn:
    """Raise a RuntimeError saying ``message``. Inside a trace of ``torch.compile``, dynamo would report an exception
    raised by traced code as its own "Observed exception", with ``message`` only in a debug line; so there it is
    raised by a function that dynamo runs for real while tracing, as dynamo's ``UserError`` (a RuntimeError), which
    dynamo passes on with ``message`` as what it says (checked on torch 2.13, CPU)."""
    if torch.compiler.is_compiling():
        _refuse_while_tracing(message)
    raise RuntimeError(message)


@torch._dynamo.assume_constant_result
def _refuse_while_tracing(message: str) -> bool:
    from torch._dynamo.exc import UserError, UserErrorType

    raise UserError(UserErrorType.INVALID_INPUT, message)
