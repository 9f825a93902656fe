"""The host's checks of a step: the tests made of every tensor of a bucket at every step, before a kernel reads it.

* :func:`owns_every_tensor`: is every parameter still a view of its bucket and every ``.grad`` the view the bucket
  installed (:meth:`~gearsam_fused.flat.Bucket.owns_every_tensor`, the common case of the layout's sync);
* :func:`state_entries` and :func:`entries_hold`: is the optimizer state the one the fused base step left
  (:mod:`gearsam_fused.base_step`).

Each has two implementations with the same answers: in C++ (``csrc/host_checks.cpp``, part of the extension
``gearsam_fused._C``), used wherever the extension is built, and in Python (:class:`PythonChecks`), used without it
and inside a trace of ``torch.compile``. The C++ one costs a few pointer comparisons per tensor where Python spends
a call or two: on 2048 small tensors the checks in Python were more than half of an eager step on the CPU
(``docs/performance.md``, "The host's checks"). :func:`using` picks one, for tests and benchmarks;
``tests/kernels/test_host_checks.py`` holds both to the same answers.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from collections.abc import Iterator, Mapping

import torch

#: the implementations by name; "cpp" only where the extension is built
IMPLEMENTATIONS = ("cpp", "python")


class PythonChecks:
    """The checks in Python, for an install without the extension and for a trace. Each works a list at a time,
    mapping built-in functions over it where it can rather than running a loop of its own."""

    @staticmethod
    def owns_every_tensor(params: list[torch.Tensor], addresses: list[int], grads: list[torch.Tensor]) -> bool:
        """Whether ``params[i].data_ptr() == addresses[i]`` and ``params[i].grad is grads[i]`` for every ``i``."""
        _lists(params=params, addresses=addresses, grads=grads)
        return list(map(_data_ptr, params)) == addresses and all(map(operator.is_, map(_grad_of, params), grads))

    @staticmethod
    def state_entries(state: dict, params: list[torch.Tensor]) -> list[dict | None]:
        """``state``'s entry for each of ``params``, found by identity, None where it has none: ``state.get(p)``
        without calling ``Tensor.__hash__``, a Python function, for each tensor."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state)}")
        _lists(params=params)
        by_id = {id(p): entry for p, entry in state.items()}
        return list(map(by_id.get, map(id, params)))

    @staticmethod
    def entries_hold(entries: list[dict | None], views: Mapping[str, list[torch.Tensor]]) -> bool:
        """Whether every one of ``entries`` is a dict and ``entries[i].get(key) is views[key][i]`` for every key of
        ``views`` and every ``i``."""
        if not isinstance(views, dict):
            raise TypeError(f"views must be a dict, got {type(views)}")
        _lists(entries=entries, **{f"views[{key!r}]": tensors for key, tensors in views.items()})
        return all(map(isinstance, entries, itertools.repeat(dict))) and all(
            all(map(operator.is_, map(dict.get, entries, itertools.repeat(key)), tensors))
            for key, tensors in views.items()
        )


def owns_every_tensor(params: list[torch.Tensor], addresses: list[int], grads: list[torch.Tensor]) -> bool:
    """Whether ``params[i].data_ptr() == addresses[i]`` and ``params[i].grad is grads[i]`` for every ``i``."""
    return _chosen().owns_every_tensor(params, addresses, grads)


def state_entries(state: dict, params: list[torch.Tensor]) -> list[dict | None]:
    """``state``'s entry for each of ``params``, found by identity (as ``state.get(p)`` finds it), None where it has
    none."""
    return _chosen().state_entries(state, params)


def entries_hold(entries: list[dict | None], views: Mapping[str, list[torch.Tensor]]) -> bool:
    """Whether every one of ``entries`` is a dict and ``entries[i].get(key) is views[key][i]`` for every key of
    ``views`` and every ``i`` (so, with no keys, whether every entry is a dict)."""
    return _chosen().entries_hold(entries, views)


def implementation(name: str):
    """The implementation ``name`` (one of :data:`IMPLEMENTATIONS`): an object with the three checks as functions.
    ValueError for another name, or for "cpp" where the extension is not built."""
    if name == "python":
        return PythonChecks
    if name == "cpp":
        module, why = _extension()
        if module is None:
            raise ValueError(
                f"the host's checks in C++ need the extension gearsam_fused._C, which is not built ({why})"
            )
        return module
    raise ValueError(f"no implementation of the host's checks is named {name!r}; choose one of {IMPLEMENTATIONS}")


def available() -> list[str]:
    """The names of the implementations this install has: "python" always, "cpp" where the extension is built."""
    return [name for name in IMPLEMENTATIONS if name == "python" or _extension()[0] is not None]


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    """Run the checks in implementation ``name`` inside the ``with`` block (for tests and benchmarks)."""
    global _selected
    before, _selected = _selected, implementation(name)
    try:
        yield
    finally:
        _selected = before


def in_use() -> str:
    """The name of the implementation the checks run in now."""
    return "python" if _chosen() is PythonChecks else "cpp"


@functools.cache
def _extension() -> tuple[object | None, str]:
    """The extension module, or None and why it cannot be used here."""
    try:
        from . import _C
    except ImportError as exc:
        return None, str(exc)
    if not hasattr(_C, "entries_hold"):
        return None, "it was built from sources older than its host checks; rebuild it"
    return _C, ""


def _chosen():
    if torch.compiler.is_compiling():
        return PythonChecks  # which dynamo traces into guards; it cannot look inside the C++ functions
    if _selected is not None:
        return _selected
    module = _extension()[0]
    return PythonChecks if module is None else module


def _lists(**lists: list) -> None:
    """TypeError unless each of ``lists`` is a list, ValueError unless each has as many items as the first: what the
    C++ checks require of their arguments."""
    size = None
    for name, items in lists.items():
        if not isinstance(items, list):
            raise TypeError(f"{name} must be a list, got {type(items)}")
        if size is not None and len(items) != size:
            raise ValueError(f"{name} has {len(items)} items where the parameters are {size}")
        size = len(items) if size is None else size


_selected = None
_data_ptr = torch.Tensor.data_ptr
_grad_of = operator.attrgetter("grad")
