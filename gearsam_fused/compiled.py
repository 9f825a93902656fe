"""What a sharpness-aware step needs to run inside ``torch.compile``: where it ends its own graph, the base
optimizer's own step kept eager, the optimizers' registry by which compiled code finds them again, and the checks
compiled code makes when it runs, registered as host operators (:func:`host_op`).

Host operators run Python on the host when compiled code runs: the checks a trace cannot make (memory addresses,
identities, version counters), kept in a compiled step as opaque operations. Each takes the flat gradient buffers
first, declared as written (``Tensor(a!)[]``), so that the compiler keeps it in the graph and orders it before what
reads or writes them. They are registered with :class:`torch.library.Library` rather than
:func:`torch.library.custom_op`, whose autograd and in-place layers run as Python on every call, several times the
cost of the check itself once a step's streams have evicted the caches. What the in-place layer did, this does too:
it advances the version counters of the buffers declared written."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from . import gradients
from .compat import graph_break, graph_may_break, mark_stepped

_LIBRARY = torch.library.Library("gearsam_fused", "FRAGMENT")


def host_op(name: str, arguments: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register the decorated function as ``gearsam_fused::name``, with the schema ``(Tensor(a!)[] grads,
    arguments) -> ()``, one kernel for every device and a fake kernel that does nothing. Call it as
    ``torch.ops.gearsam_fused.name``: a compiled step then holds the call, not the function's body."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        _LIBRARY.define(f"{name}(Tensor(a!)[] grads, {arguments}) -> ()")

        def kernel(grads: list[torch.Tensor], *args) -> None:
            fn(grads, *args)
            torch.autograd.graph.increment_version(grads)

        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"gearsam_fused::{name}", lambda grads, *args: None, lib=_LIBRARY)
        return fn

    return register


@torch.compiler.disable
def eager_step(opt) -> None:
    _base_step(opt)


def _base_step(opt) -> None:
    opt.base_optimizer.step()
    if opt._flat_step is not None:
        opt._flat_step.invalidate()  # the step may have made new state: the next fused step checks it again


def step_per_tensor(opt) -> None:
    """The base optimizer's own ``step()`` for the sharpness-aware optimizer ``opt``. Inside a compiled step over
    re-homed parameters it runs eagerly (a graph break, like those torch's ``step()`` makes around itself): the
    compiler refuses a step that writes parameters sharing one buffer ("non-differentiable view input mutations")."""
    if opt.backend.fuses_base_step and torch.compiler.is_compiling():
        eager_step(opt)
    else:
        _base_step(opt)


def own_graph() -> None:
    """Inside a larger compiled function (a whole training step), end the graph here, so that the step's writes to
    the flat buffers and the model's reads of the parameters, views of them, are never in one graph: AOT autograd
    refuses graphs that write an input sharing memory with other inputs. A no-op in eager code and under
    ``fullgraph=True``, where the step is all there is to compile."""
    if torch.compiler.is_compiling() and graph_may_break():
        graph_break()


_OPTIMIZERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(optimizer) -> int:
    """A key under which compiled code finds ``optimizer`` when it runs (its id, held weakly)."""
    _OPTIMIZERS[id(optimizer)] = optimizer
    return id(optimizer)


def mark_stepped_now(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's LR schedulers that ``optimizer`` stepped. Compiled code marks it when it is traced, at its first
    call (:func:`mark_stepped_when_traced`): the mark is never cleared, so once is all it takes, and a compiled setattr
    on an optimizer is what dynamo could not trace ("Attempted setattr on a user-defined object that does not have an
    AttributeMutation mutation_type")."""
    if torch.compiler.is_compiling():
        mark_stepped_when_traced(optimizer)
    else:
        mark_stepped(optimizer)


@torch.compiler.assume_constant_result
def mark_stepped_when_traced(optimizer: torch.optim.Optimizer) -> bool:
    """:func:`mark_stepped_now` for compiled code: run for real while dynamo traces the step, not by the compiled
    code, which so never sets an attribute of an optimizer. It takes the optimizer, not a key: dynamo makes an integer
    dynamic once it has compiled the same code for two values of it (two optimizers' keys), and a dynamic integer is
    no constant to run this with."""
    mark_stepped(optimizer)
    return True


# Declared as writing the gradient buffers, though it only reads them: so that it stays in the graph, before the
# sync that copies new gradients in.
@host_op("check_second_gradient_", "int optimizer")
def check_second_gradient_(grads: list[torch.Tensor], optimizer: int) -> None:
    """:meth:`SharpnessAware.second_step`'s check that a backward ran after ``first_step`` and an in-place
    ``zero_grad``, made when compiled code runs; ``grads`` are the optimizer's flat gradient buffers."""
    opt = _OPTIMIZERS.get(optimizer)
    if opt is None:
        raise RuntimeError("the optimizer this compiled step belongs to no longer exists")
    if gradients.missing(opt):
        gradients.refuse(opt)


# Declared as writing the gradient buffers, though it only reads them, for the same reason: before the update.
@host_op("check_ready_", "int optimizer")
def check_ready_(grads: list[torch.Tensor], optimizer: int) -> None:
    """The checks that a step compiled whole left out of its plan of the buckets whose flat gradient buffers are
    ``grads`` (:meth:`~gearsam_fused.base_step.FlatBaseStep.why_not_ready`), made when the compiled code runs. Where one
    fails, the step is abandoned with an error and the next call compiles the step again."""
    opt = _OPTIMIZERS.get(optimizer)
    if opt is None:
        raise RuntimeError("the optimizer this compiled step belongs to no longer exists")
    addresses = {g.data_ptr() for g in grads}
    for bucket in opt._flat_step.layout.buckets:
        reason = opt._flat_step.why_not_ready(bucket, synced=True) if bucket.grad.data_ptr() in addresses else ""
        if reason:
            opt._flat_step.invalidate()
            kept = gradients.abandon(opt)
            raise RuntimeError(
                f"second_step, compiled with fullgraph=True when every parameter had a gradient and the optimizer "
                f"state the last step left, found that {reason}: the weights were restored to w and no step was "
                f"taken{kept}. Its next call compiles it again for what it finds; a parameter without a gradient "
                "then needs the base optimizer's own step, which fullgraph=True refuses"
            )
