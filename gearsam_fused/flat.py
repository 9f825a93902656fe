"""Flat layout: each (device, dtype, param group) bucket of parameters re-homed as views of one contiguous buffer.

A bucket holds three buffers of the same length, ``param``, ``grad`` and ``backup``, laid out by block (and, made on
first use, one buffer per optimizer-state tensor, e.g. Adam's ``exp_avg``, with per-parameter views)::

    | block 0: w0 .. w1 .. w2 ..... | block 1: w3 .. w4 ... | block 2 (empty here) | block 3: ...
      ^ tensor starts on multiples of ALIGN elements
                                    ^ block starts on multiples of TILE elements

* Every parameter's ``.data`` is a view of ``param`` with the parameter's own shape and strides, so the model, its
  ``state_dict`` and the base optimizer see the same Parameter objects and values as before.
* Every gradient is a view of ``grad`` at the same place, so ``backward`` accumulates straight into the flat buffer.
* Blocks start on tile boundaries, so a kernel tile of ``TILE`` elements lies in exactly one block; the tables
  ``block_of_tile`` (tile -> its block), ``first_tile_of_block`` (block b -> its tiles ``[first[b], first[b + 1])``,
  B + 1 entries) and ``tile_count_of_block`` are built once and live on the device.
* On a Linux CPU every flat buffer is advised onto transparent huge pages before it is first written
  (:mod:`gearsam_fused.memory`).
* Padding is zero in ``param`` and ``grad`` and stays zero: a perturbation adds ``scale * 0`` there.
* Parameters of different param groups never share a bucket, so one set of hyperparameters (lr, weight decay, ...)
  holds for a whole bucket and a base-optimizer update can run over it in one pass.

Gradients stop being views when someone sets them to None (``zero_grad(set_to_none=True)``) or assigns a new tensor;
parameters stop being views when someone assigns ``p.data``. :meth:`FlatLayout.sync` detects both before the buffers
are read and puts the values back in place (re-homing the tensor), so a kernel never reads a stale buffer.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .checks import check_dense_grad
from .compat import raise_refusal
from .compiled import host_op
from .memory import flat_empty, flat_zeros
from .partition import Block

#: Tensor starts are multiples of this many elements (256 bytes in float32): aligned for vectorised access.
ALIGN = 64
#: Kernel tile in elements; block ranges are padded to a multiple of it. A power of two (Triton's ``tl.arange``).
TILE = 2048


@functools.cache
def _owns_every_tensor():
    """``gearsam_fused._C.owns_every_tensor``, None where the extension is not built: whether ``params[i].data_ptr()
    == addresses[i]`` and ``params[i].grad is grads[i]`` for every ``i``, two pointer comparisons per tensor where
    Python spends a call or two."""
    try:
        from . import _C
    except ImportError:
        return None
    return getattr(_C, "owns_every_tensor", None)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _dense_layout(name: str, p: torch.Tensor) -> None:
    """Refuse parameters whose elements do not fill their memory span exactly once (they cannot be a flat slice)."""
    if p.numel() == 0:
        return  # any strides describe an empty tensor; it becomes an empty slice
    dims = sorted((stride, size) for stride, size in zip(p.stride(), p.shape) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            raise ValueError(
                f"parameter {name!r} (shape {tuple(p.shape)}, strides {p.stride()}) overlaps itself or has gaps in "
                "memory; fused backends need dense parameters (use .contiguous() before building the optimizer) "
                "or backend='reference'"
            )
        expected *= size


def _describe(device, dtype, shape, stride) -> str:
    return f"{str(dtype).removeprefix('torch.')} {list(shape)} strides {list(stride)} on {device}"


@dataclass
class _Slot:
    """One parameter's place in its bucket."""

    name: str
    param: torch.nn.Parameter
    view: torch.Tensor  # the parameter's storage from now on
    grad_view: torch.Tensor  # where its gradient lives
    dirty: bool = False  # the grad region may be non-zero: it is, or was since we last zeroed it, the .grad

    # FlatLayout.sync checks every tensor before every step, so it uses the cheapest sufficient tests. The parameter is
    # still ours while param.data_ptr() == view_address plus the bucket's shift (Bucket.shift): a replaced .data lives
    # elsewhere, since nothing but a view of our live buffers can start inside them. The gradient is still ours while
    # param.grad is grad_view: the .grad we set keeps its Python object as long as we hold it, so any other object is a
    # new gradient (one that happens to share our memory is copied onto itself, harmlessly).

    def __post_init__(self):
        self.view_address = self.view.data_ptr()
        self.offset = self.view.storage_offset()  # read once: a trace cannot read it


class Bucket:
    """The parameters of one (device, dtype, param group), their flat buffers and the tile tables of their blocks."""

    def __init__(self, device: torch.device, dtype: torch.dtype, members: list[tuple[int, str, torch.Tensor]],
                 n_blocks: int, tile: int = TILE, align: int = ALIGN, group: int = 0):  # fmt: skip
        self.device, self.dtype, self.tile = device, dtype, tile
        #: index of the param group every parameter of this bucket belongs to
        self.group = group
        # members arrive in block order, so offsets come out in the same order as they do
        per_block: dict[int, list[torch.Tensor]] = {}
        for b, _, p in members:
            per_block.setdefault(b, []).append(p)
        offsets, tile_count_of_block, cursor = [], [], 0
        for b in range(n_blocks):
            start = cursor
            for p in per_block.get(b, ()):
                cursor = _round_up(cursor, align)
                offsets.append(cursor)
                cursor += p.numel()
            cursor = _round_up(cursor, tile)
            tile_count_of_block.append((cursor - start) // tile)
        self.numel = cursor
        self.n_tiles = cursor // tile
        self.param, self.grad = self.new_zeros(), self.new_zeros()
        self.backup = flat_empty(cursor, dtype, device)
        self._param_address = self.param.data_ptr()
        counts = torch.tensor(tile_count_of_block, dtype=torch.int64)
        self.tile_count_of_block = counts.to(device)
        self.first_tile_of_block = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(device)
        self.block_of_tile = torch.repeat_interleave(torch.arange(n_blocks, dtype=torch.int32), counts).to(device)
        # per-tile sums: the energies' in the first n_tiles, an inner product's beside them (block_energy with other)
        self.partials = torch.empty(2 * self.n_tiles, dtype=torch.float64, device=device)
        #: flat optimizer-state buffers by state name, and every slot's view of each (see :meth:`state_buffer`)
        self.state: dict[str, torch.Tensor] = {}
        self.state_views: dict[str, list[torch.Tensor]] = {}
        self._counts: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        #: the name of the first parameter that had no gradient at the last :meth:`FlatLayout.sync_now` (None: none)
        self.missing_grad: str | None = None
        #: the value every entry of :meth:`step_counts` held after the base step last read or advanced it (None before)
        self.counted: int | None = None
        #: every slot's gradient region may be non-zero (as if each :attr:`_Slot.dirty`): set where all of them are,
        #: so that the common case of a sync sets one flag instead of one per slot; see :meth:`slots_dirty`
        self.all_dirty = False

        self.slots: list[_Slot] = []
        self._addresses: dict[int, list[int]] = {}  # by shift: where each slot's parameter lives (owns_every_tensor)
        with torch.no_grad():
            for (_, name, p), offset in zip(members, offsets):
                view = torch.as_strided(self.param, p.shape, p.stride(), offset)
                grad_view = torch.as_strided(self.grad, p.shape, p.stride(), offset)
                slot = _Slot(name, p, view, grad_view)
                view.copy_(p.detach())
                p.data = view
                if check_dense_grad(p.grad, repr(name)) is not None:
                    grad_view.copy_(p.grad)
                    p.grad = grad_view
                    slot.dirty = True
                self.slots.append(slot)
        #: every slot's parameter, in slot order
        self.params = [slot.param for slot in self.slots]
        self._grad_views = [slot.grad_view for slot in self.slots]

    @property
    def shift(self) -> int:
        """How far the parameter buffer's memory is from where it was allocated: 0, or the distance to the backup's
        first memory after the CPU kernels exchanged the two buffers' memory (``csrc/cpu/exchange.h``), which every
        parameter, a view of the buffer, followed."""
        return self.param.data_ptr() - self._param_address

    def new_zeros(self) -> torch.Tensor:
        """A flat buffer of zeros laid out like ``param`` (on huge pages where :mod:`gearsam_fused.memory` gets
        them)."""
        return flat_zeros(self.numel, self.dtype, self.device)

    @property
    def padding(self) -> int:
        return self.numel - sum(s.view.numel() for s in self.slots)

    def state_buffer(self, key: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The flat buffer of optimizer state ``key`` (zeros when first asked for) and each slot's view of it, laid
        out like ``param``: a state tensor of a parameter is a view at the parameter's place."""
        if key not in self.state and torch.compiler.is_compiling():
            # tensors made inside a compiled step and kept across steps come out wrong (torch 2.13)
            raise_refusal(
                f"optimizer state {key!r} does not exist yet and a step compiled with torch.compile cannot create it "
                "(an option changed since the optimizer was built, e.g. momentum from 0); run one step without "
                "torch.compile first"
            )
        if key not in self.state:
            flat = self.new_zeros()
            self.state[key] = flat
            self.state_views[key] = [torch.as_strided(flat, s.view.shape, s.view.stride(), s.offset)
                                     for s in self.slots]  # fmt: skip
        return self.state[key], self.state_views[key]

    def step_counts(self, dtype: torch.dtype, on_device: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A vector of per-slot step counts (zeros when first asked for) and each slot's 0-d view of it: torch's Adam
        keeps ``state["step"]`` as such a scalar per parameter; as views of one vector they are all advanced by one
        operation. On the CPU, read without touching the device; with ``on_device`` (a capturable step, as torch's
        capturable Adam keeps them) on the bucket's device, advanced without reading them."""
        if self._counts is None:
            if torch.compiler.is_compiling():
                raise_refusal("a step compiled with torch.compile cannot create Adam's step counts")
            counts = torch.zeros(len(self.slots), dtype=dtype, device=self.device if on_device else "cpu")
            self._counts = counts, list(counts.unbind())
        return self._counts

    def owns_every_tensor(self) -> bool:
        """Whether every parameter is still a view of :attr:`param` and every ``.grad`` the view we installed: the
        common case of :meth:`FlatLayout.sync_now`, tested a bucket at a time in C++ (``csrc/host_checks.cpp``).
        False without the extension: the sync then tests a slot at a time, as it does when this answers False."""
        check = _owns_every_tensor()
        if check is None:
            return False
        shift = self.shift
        addresses = self._addresses.get(shift)
        if addresses is None:  # one list per shift seen: the exchange (csrc/cpu/exchange.h) alternates two
            addresses = self._addresses[shift] = [slot.view.data_ptr() for slot in self.slots]
        return check(self.params, addresses, self._grad_views)

    def slots_dirty(self) -> list[_Slot]:
        """The slots, with :attr:`all_dirty` moved onto each one's ``dirty`` (and cleared), for a pass that reads or
        sets them one at a time."""
        if self.all_dirty:
            for slot in self.slots:
                slot.dirty = True
            self.all_dirty = False
        return self.slots

    @property
    def counts(self) -> torch.Tensor | None:
        """The vector of :meth:`step_counts`, None before it is first asked for."""
        return None if self._counts is None else self._counts[0]

    def check_counted(self) -> None:
        """Refuse step counts changed behind the base step's back: a compiled step takes the count from
        :attr:`counted`, since a trace cannot read the vector."""
        if self._counts is not None and self.counted is not None and not bool((self._counts[0] == self.counted).all()):
            raise RuntimeError(
                f"the Adam step counts (state['step']) of the parameters of param group {self.group} were changed in "
                f"place since the optimizer set them to {self.counted}; a compiled step cannot read them: change them "
                "through load_state_dict, or step eagerly once after changing them"
            )

    @property
    def energy_partials(self) -> torch.Tensor:
        """The first :attr:`n_tiles` entries of :attr:`partials`: what an energy pass alone writes."""
        return self.partials[: self.n_tiles]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the bucket allocated, by role."""
        return {
            "param": self.param, "grad": self.grad, "backup": self.backup, "partials": self.partials,
            "tile_count_of_block": self.tile_count_of_block, "first_tile_of_block": self.first_tile_of_block,
            "block_of_tile": self.block_of_tile,
            **{f"state.{key}": flat for key, flat in self.state.items()},
        }  # fmt: skip


class FlatLayout:
    """Re-homes the parameters of ``blocks`` into per-(device, dtype, param group) buckets; see the module docstring.
    ``param_group`` maps ``id(p)`` to the index of ``p``'s param group (all in group 0 when not given)."""

    def __init__(self, blocks: list[Block], tile: int = TILE, align: int = ALIGN,
                 param_group: Mapping[int, int] | None = None):  # fmt: skip
        if tile <= 0 or tile & (tile - 1):
            raise ValueError(f"tile must be a power of two, got {tile}")
        param_group = param_group or {}
        keyed: dict[tuple[torch.device, torch.dtype, int], list[tuple[int, str, torch.Tensor]]] = {}
        for b, block in enumerate(blocks):
            for name, p in zip(block.param_names, block.params):
                _dense_layout(name, p)
                keyed.setdefault((p.device, p.dtype, param_group.get(id(p), 0)), []).append((b, name, p))
        self.n_blocks = len(blocks)
        self.buckets = [
            Bucket(dev, dt, members, len(blocks), tile, align, group) for (dev, dt, group), members in keyed.items()
        ]
        #: how compiled code finds this layout again (see :func:`sync_`)
        self.key = _register(self)

    # ------------------------------------------------------------------ keeping the views honest
    def sync(self) -> None:
        """Make the flat buffers hold the current parameters and gradients.

        A parameter whose ``.data`` was replaced by other memory is copied back in and re-homed (a change of device,
        dtype, shape or strides is refused). A gradient other than the view we installed is copied in and re-homed; a
        region whose parameter now has no gradient is zeroed, so it contributes nothing and that ``.grad`` stays None.

        Under ``torch.compile`` the same checks run each time the compiled code runs, not once when it is traced:
        they compare memory addresses, which a trace cannot see, so the graph holds them as one opaque operation
        (:func:`sync_`) that declares the gradient buffers it writes. A replaced parameter is refused there instead of
        re-homed: declaring writes to the parameter buffer too would be right, but Inductor (torch 2.13) miscompiles a
        copy of a buffer that an opaque operation wrote (the backup would hold ``w + eps``).
        """
        if torch.compiler.is_compiling():
            # the step counts are passed only to be declared read: the step advances them in place later in the same
            # graph, and nothing else would keep the compiler from writing them before sync_ checks them
            counts = [bucket.counts for bucket in self.buckets if bucket.counts is not None]
            torch.ops.gearsam_fused.sync_([bucket.grad for bucket in self.buckets], counts, self.key)
        else:
            self.sync_now()

    @torch.no_grad()
    def sync_now(self, rehome: bool = True) -> None:
        """:meth:`sync`, run eagerly; with ``rehome=False`` a replaced parameter is an error."""
        for bucket in self.buckets:
            bucket.missing_grad = None
            if bucket.owns_every_tensor():
                bucket.all_dirty = True
                continue
            stale: list[_Slot] = []
            copied: list[_Slot] = []
            sources: list[torch.Tensor] = []
            shift = bucket.shift
            for slot in bucket.slots_dirty():
                p = slot.param
                if p.data_ptr() - shift != slot.view_address:
                    self._rehome_param(bucket, slot, rehome)
                g = p.grad
                if g is slot.grad_view:
                    slot.dirty = True
                elif g is None:
                    if bucket.missing_grad is None:
                        bucket.missing_grad = slot.name
                    if slot.dirty:
                        stale.append(slot)
                else:
                    check_dense_grad(g, repr(slot.name))
                    copied.append(slot)
                    sources.append(g.detach())
            # acted on once every slot passed its checks: a parameter refused above leaves every gradient as it was
            if stale:
                torch._foreach_zero_([slot.grad_view for slot in stale])
                for slot in stale:
                    slot.dirty = False
            if copied:
                torch._foreach_copy_([slot.grad_view for slot in copied], sources)
                for slot in copied:
                    slot.param.grad = slot.grad_view
                    slot.dirty = True

    @staticmethod
    def _rehome_param(bucket: Bucket, slot: _Slot, rehome: bool) -> None:
        p = slot.param
        now = (p.device, p.dtype, tuple(p.shape), p.stride())
        placed = (bucket.device, bucket.dtype, tuple(slot.view.shape), slot.view.stride())
        if now != placed:
            raise RuntimeError(
                f"parameter {slot.name!r} was replaced by a tensor of another device, dtype, shape or memory layout "
                f"({_describe(*now)}, was {_describe(*placed)}) after the optimizer placed it; build the optimizer "
                "after moving, casting or converting the model"
            )
        if not rehome:
            raise RuntimeError(
                f"parameter {slot.name!r} was replaced (its .data assigned) after the optimizer placed it; a compiled "
                "step cannot put it back in place: run one step without torch.compile after replacing parameters"
            )
        slot.view.copy_(p.detach())
        p.data = slot.view

    @torch.no_grad()
    def zero_grads_(self) -> None:
        """``zero_grad(set_to_none=False)``: one fill per bucket; gradients that exist become zeroed views."""
        for bucket in self.buckets:
            bucket.all_dirty = False  # set per slot below
            for slot in bucket.slots:
                g = slot.param.grad
                if g is not None and g is not slot.grad_view:
                    slot.param.grad = slot.grad_view
                # a region handed out as .grad can be written by anyone (backward, the user) until we look again
                slot.dirty = g is not None
            bucket.grad.zero_()

    def memory_overhead(self) -> dict[str, int]:
        """Bytes allocated beyond the parameters and gradients themselves."""
        backup = sum(b.backup.nbytes for b in self.buckets)
        # param, grad and every flat state buffer carry the same padding; the state itself is the base optimizer's
        padding = sum((2 + len(b.state)) * b.padding * b.param.element_size() for b in self.buckets)
        tables = sum(
            t.nbytes
            for b in self.buckets
            for k, t in b.tensors().items()
            if k not in ("param", "grad", "backup") and not k.startswith("state.")
        )
        grad_buffer = sum(b.grad.nbytes for b in self.buckets)
        return {"backup": backup, "padding": padding, "tables": tables, "total": backup + padding + tables,
                "grad_buffer": grad_buffer}  # fmt: skip


_LAYOUTS: weakref.WeakValueDictionary[int, FlatLayout] = weakref.WeakValueDictionary()


def _register(layout: FlatLayout) -> int:
    """A key under which :func:`sync_` finds ``layout`` when compiled code runs (the layout's id, held weakly)."""
    _LAYOUTS[id(layout)] = layout
    return id(layout)


@host_op("sync_", "Tensor[] counts, int layout")
def sync_(grads: list[torch.Tensor], counts: list[torch.Tensor], layout: int) -> None:
    """:meth:`FlatLayout.sync_now` (without re-homing parameters) of the layout registered under ``layout``, whose
    flat gradient buffers (every bucket's, in order) are ``grads``, then :meth:`Bucket.check_counted` of the buckets'
    step counts, ``counts`` (those that exist, in bucket order: read through the buckets, declared here so that the
    compiler orders the step's own update of them after this check). It writes the gradient buffers through views of
    its own, so it refuses copies of them (a compiler that handed it copies would lose what it wrote)."""
    target = _LAYOUTS.get(layout)
    if target is None:
        raise RuntimeError("the optimizer whose flat buffers this compiled step syncs no longer exists")
    mine = [bucket.grad for bucket in target.buckets]
    if len(mine) != len(grads) or any(a.data_ptr() != b.data_ptr() for a, b in zip(mine, grads)):
        raise RuntimeError("sync_ was handed copies of the flat gradient buffers instead of the buffers themselves")
    target.sync_now(rehome=False)
    for bucket in target.buckets:
        bucket.check_counted()


def compact_state_dict(state: dict) -> dict:
    """``state`` with every tensor copied into memory of its own, for saving part of a model.

    With a fused backend every parameter is a view of its bucket's flat buffer, and ``torch.save`` writes a view's
    whole underlying buffer: ``torch.save(model.fc.state_dict(), path)`` would store every parameter of the model.
    ``torch.save(compact_state_dict(model.fc.state_dict()), path)`` stores the head alone. (Saving the whole model
    needs nothing: the buffer then holds what is saved, once.)"""
    compact = type(state)((k, v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items())
    if hasattr(state, "_metadata"):  # nn.Module.state_dict's version records, read back by load_state_dict
        compact._metadata = state._metadata
    return compact
