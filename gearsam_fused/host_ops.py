"""Registered operators that run Python on the host when compiled code runs: the checks a trace cannot make (memory
addresses, identities, version counters), kept in a compiled step as opaque operations.

Each takes the flat gradient buffers first, declared as written (``Tensor(a!)[]``), so that the compiler keeps it in
the graph and orders it before what reads or writes them. They are registered with :class:`torch.library.Library`
rather than :func:`torch.library.custom_op`, whose autograd and in-place layers run as Python on every call, several
times the cost of the check itself once a step's streams have evicted the caches. What the in-place layer did, this
does too: it advances the version counters of the buffers declared written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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
