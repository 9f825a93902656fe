"""The contract every backend implements: a few operations over an ordered list of parameter blocks.

The optimizer frontend owns the algorithm (which energies, which allocation rule, when to restore); a backend owns
only how the tensor work is done. One step is::

    energy = block_energy(adaptive, eta)                       # e_b, float64 [B]
    scale, radius = allocate(rule, energy, ema, rho, beta, delta)
    perturb_(scale, adaptive, eta)                             # parameters now hold w + eps
    ...                                                        # the caller's second backward
    restore_()                                                 # parameters hold w again, bit for bit

or, in place of ``restore_()`` and the base optimizer's own step, where the backend fuses the base step
(:attr:`Backend.fuses_base_step`; see :mod:`gearsam_fused.base_step`)::

    restore_and_update_(updates)                               # w restored and updated by SGD/Adam(W), one pass

A step whose second pass a schedule skips (:mod:`gearsam_fused.schedules`) perturbs nothing and ends with
``update_(updates, correction_scale)``, the same update from the current weights; LookSAM adds ``keep_gradient_``,
``block_dot`` and ``orthogonalize_`` to a perturbing step.

A one-pass step (:class:`~gearsam_fused.MomentumSAM`) perturbs along the base optimizer's momentum rather than the
gradients, after the base update::

    restore_and_update_(updates)                               # or update_(updates): no look-ahead yet
    energy = direction_energy(momentum, adaptive, eta)         # of the new momentum
    scale, radius = allocate(rule, energy, ema, rho, beta, delta)
    perturb_along_(-scale, momentum, adaptive, eta)            # the look-ahead point w - r * v / ||v||
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from ..allocation import allocate
from ..checks import check_dense_grad
from ..family import Mix
from ..partition import Block
from ..sharding import local

#: The buffers a backend may keep beside the parameters, laid out like the gradients: the kept gradient (LookSAM's
#: g, then g_v; GSAM's and WSAM's first gradient) and F-SAM's EMA of the gradients (:mod:`gearsam_fused.family`).
#: ``direction``: a copy of a :class:`Direction` given per tensor, where a flat-buffer backend needs it flat.
CORRECTION, MOMENTUM, DIRECTION = "correction", "momentum", "direction"
BUFFERS = (CORRECTION, MOMENTUM, DIRECTION)


class Direction(NamedTuple):
    """A perturbation direction other than the gradients (the base optimizer's momentum): per block, one tensor or
    None per parameter of the block (a parameter without one is not perturbed and adds no energy); and, where the
    flat-buffer backends hold the direction as a flat buffer laid out like a bucket's gradient (the fused base step's
    state), that buffer by ``id(bucket)``, which they read in place of the tensors."""

    tensors: list[list[torch.Tensor | None]]
    flat: dict[int, torch.Tensor] = {}


class Backend:
    """Base class. ``blocks`` is the optimizer's partition; ``device`` receives energies, EMA and radii;
    ``param_group`` maps ``id(p)`` to the index of ``p``'s param group. A subclass implements :meth:`block_energy`,
    ``_perturb``, ``_restore`` and :meth:`memory_overhead`, and, if it sets :attr:`fuses_base_step`,
    ``_restore_and_update``."""

    name = "abstract"
    #: Whether :meth:`restore_and_update_` can run (the backend keeps flat buckets and their optimizer state).
    fuses_base_step = False
    #: Whether the kernels read rho, lr and the step count from the device and skip an overflowing step there
    #: (``capturable=True``; :mod:`gearsam_fused.capturable`).
    capturable = False
    #: Whether :meth:`restore_and_update_` takes ``mix`` in its own pass (the kernels' corrected base step) rather than
    #: by :meth:`mix_gradient_` before it.
    folds_mix = False
    #: Whether :meth:`perturb_` keeps the gradients (``keep=True``) in its own pass rather than by
    #: :meth:`keep_gradient_` before it.
    folds_keep = False
    #: The SAM family's operations (:mod:`gearsam_fused.family`) that run as registered operators (``torch.library``),
    #: which a compiled step calls as they are: a part that needs any other one cannot be compiled on this backend.
    family_operators: frozenset[str] = frozenset()

    def __init__(self, blocks: list[Block], device: torch.device, param_group: Mapping[int, int] | None = None):
        self.blocks = blocks
        self.device = device
        self.param_group = param_group
        #: Whether the parameters hold ``w + eps``: set by :meth:`perturb_`, cleared by :meth:`restore_`. The one record
        #: of it; the optimizer reads it from here.
        self.perturbed = False
        # name -> id(p) -> that buffer of p, made on first use (BUFFERS: LookSAM's or GSAM's and WSAM's kept gradient,
        # F-SAM's gradient EMA); the flat-buffer backends key them by bucket instead
        self._buffers: dict[str, dict[int, torch.Tensor]] = {name: {} for name in BUFFERS}

    @staticmethod
    def installed() -> bool:
        """Whether this installation has what the backend needs (a package, a compiled extension)."""
        return True

    @staticmethod
    def check_usable(devices: set[torch.device]) -> None:
        """Raise ``ValueError``, saying what to do, unless the backend can run on parameters on ``devices``."""

    def block_energy(self, adaptive: bool, eta: float) -> torch.Tensor:
        """float64 ``[B]`` on ``self.device``: ``e_b = sum_{p in b} ||T_p * g_p||^2`` with ``T_p = |p| + eta`` if
        ``adaptive`` else 1. Parameters whose ``grad`` is None contribute nothing."""
        raise NotImplementedError

    def allocate(self, rule: str, energy: torch.Tensor, ema: torch.Tensor, rho: float | torch.Tensor, beta: float,
                 delta: float, found_inf: torch.Tensor | None = None):  # fmt: skip
        """``(scale, radius)``, float64 ``[B]``, by ``rule`` (one of :data:`gearsam_fused.allocation.RULES`);
        GEAR-SAM's updates ``ema`` in place. Runs on the device without reading anything back to the host. ``rho``
        may be a float64 0-d tensor on the device; where ``found_inf`` is set, every scale and radius is 0 and ``ema``
        is not written."""
        return allocate(rule, energy, ema, rho, beta, delta, found_inf)

    def perturb_(self, scale: torch.Tensor, adaptive: bool, eta: float, keep: bool = False) -> None:
        """Save the parameters, then ``p += scale[b] * T_p**2 * g_p`` in place for every parameter with a gradient
        (using the gradients as :meth:`block_energy` last read them). ``keep``: :meth:`keep_gradient_` as well, in the
        same pass where the backend :attr:`folds_keep`."""
        if self.perturbed:
            raise RuntimeError("perturb_ called twice without restore_: the parameters already hold w + eps")
        if keep and self.folds_keep:
            self._perturb(scale, adaptive, eta, keep=True)
        else:
            if keep:
                self.keep_gradient_()
            self._perturb(scale, adaptive, eta)
        self.perturbed = True

    # The per-tensor backends' block_energy and _perturb take a direction in place of the gradients as a last
    # argument; the flat-buffer backends read it as a flat buffer per bucket instead.
    def direction_energy(self, direction: Direction, adaptive: bool, eta: float) -> torch.Tensor:
        """:meth:`block_energy` of ``direction``'s tensors in place of the gradients (the same reduction)."""
        return self.block_energy(adaptive, eta, direction)

    def perturb_along_(self, scale: torch.Tensor, direction: Direction, adaptive: bool, eta: float) -> None:
        """:meth:`perturb_` along ``direction`` in place of the gradients: save the parameters, then
        ``p += scale[b] * T_p**2 * d_p`` for every parameter with a direction tensor."""
        if self.perturbed:
            raise RuntimeError("perturb_along_ called twice without restore_: the parameters already hold w + eps")
        self._perturb_along(scale, direction, adaptive, eta)
        self.perturbed = True

    def forget_(self) -> None:
        """Drop the saved copy without putting it back: the parameters keep what they hold (a state dict being loaded
        replaces both)."""
        self._forget()
        self.perturbed = False

    def _forget(self) -> None:
        """:meth:`forget_`'s work: nothing where the next :meth:`perturb_` overwrites the saved copy."""

    def _perturb_along(self, scale: torch.Tensor, direction: Direction, adaptive: bool, eta: float) -> None:
        self._perturb(scale, adaptive, eta, direction)

    def restore_(self) -> None:
        """Put back, bit for bit, every parameter saved by the last :meth:`perturb_` (nothing if none is saved). The
        saved copy is not read again (the ``cpp`` CPU kernels may exchange its memory with the parameters')."""
        if self.perturbed:
            self._restore()
        self.perturbed = False

    def restore_and_update_(self, updates: list, found_inf: torch.Tensor | None = None, mix: Mix | None = None,
                            momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        """:meth:`restore_` and the base optimizer's update in one pass per bucket: for each
        :class:`~gearsam_fused.base_step.BucketUpdate`, ``w <- update(backup, grad, state)`` written to the
        parameters and the state (the parameters' perturbed values are never read). Where ``found_inf`` (a float32
        one-element tensor on the device, :attr:`capturable` backends) is set: ``w <- backup``, the state untouched.

        ``mix`` (:class:`~gearsam_fused.family.Mix`): the update's gradient is the one :meth:`mix_gradient_` makes of
        its scales (the SAM family's descent gradient), bit for bit. Where the backend :attr:`folds_mix`, the update
        computes it as it reads ``grad`` and the gradients keep ``h``; elsewhere :meth:`mix_gradient_` writes it into
        the gradients first. Its ``sharpness`` step, only where the backend folds the mix, follows the update in the
        same pass: ``w <- fma(C(-lr * sharpness), h - g, w)`` with ``h - g`` rounded on its own, lr the bucket's.

        ``momentum_energy`` (not with ``found_inf``: a skipped step writes no momentum): returns the block energies of
        the new momentum, each update's first state buffer (SGD's momentum buffer, Adam's ``exp_avg``), float64
        ``[B]``: :meth:`direction_energy` of it (``adaptive`` False), bit for bit. The kernel backends sum each tile as
        the update writes it (MomentumSAM's one pass); the others read the momentum again after the update."""
        if momentum_energy and found_inf is not None:
            raise ValueError("momentum_energy is not taken with found_inf: a skipped step writes no momentum")
        if not self.perturbed:
            raise RuntimeError("restore_and_update_ without perturb_: there is no saved w to update from")
        if found_inf is not None and not self.capturable:
            raise NotImplementedError(f"backend {self.name!r} does not skip an overflowing step on the device")
        if mix is not None and not self.folds_mix:
            if mix.sharpness != 0.0:
                raise ValueError(
                    f"backend {self.name!r} does not fold the mix into its base step, so it cannot take its sharpness "
                    "step; exchange the gradients and add the sharpness after the update instead"
                )
            self.mix_gradient_(mix.grad_scale, mix.kept_scale)
            mix = None
        energy = self._restore_and_update(updates, found_inf, mix, momentum_energy)
        self.perturbed = False
        return energy

    def update_(self, updates: list, correction_scale: torch.Tensor | None = None,
                momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        """The base optimizer's update of the current weights, without a perturbation to undo (a step whose second
        pass a schedule skipped, or MomentumSAM's first step), one pass per bucket; with ``correction_scale`` (float64
        ``[B]``) the gradient is ``g + correction_scale[b] * correction`` (LookSAM). As :meth:`restore_and_update_`
        otherwise, ``momentum_energy`` included."""
        if self.perturbed:
            raise RuntimeError("update_ while the parameters hold w + eps: restore them first")
        return self._update(updates, correction_scale, momentum_energy)

    def _update(self, updates: list, correction_scale: torch.Tensor | None,
                momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        raise NotImplementedError(f"backend {self.name!r} does not fuse the base optimizer's step")

    # LookSAM's direction (gearsam_fused.schedules.LookSAM): one buffer the size of the parameters holds the first
    # gradient from first_step to second_step, then the orthogonal part g_v of the SAM gradient until the next SAM
    # step. Allocated on first use. Written here per tensor, straight from the formulas (the reference backend's and
    # the sharded backend's implementation); the flat-buffer backends do the same per bucket.
    def _buffer(self, name: str, p: torch.Tensor) -> torch.Tensor:
        store = self._buffers[name]
        kept = store.get(id(p))
        if kept is None:
            kept = store[id(p)] = torch.zeros_like(local(p))
        return kept

    def _params_and_grads(self):
        """(block index, parameter, local gradient or None) for every parameter, in block order."""
        for b, block in enumerate(self.blocks):
            for name, p in zip(block.param_names, block.params):
                g = check_dense_grad(p.grad, repr(name))
                yield b, p, None if g is None else local(g)

    def _named_grads(self):
        """(block index, correction, local gradient or None) for every parameter, in block order."""
        for b, p, g in self._params_and_grads():
            yield b, self._buffer(CORRECTION, p), g

    @torch.no_grad()
    def keep_gradient_(self) -> None:
        """``correction <- g``, the current gradients (zero where a parameter has none)."""
        for _, kept, g in self._named_grads():
            kept.zero_() if g is None else kept.copy_(g)

    @torch.no_grad()
    def block_dot(self) -> torch.Tensor:
        """float64 ``[B]``: ``sum_{p in b} <correction_p, g_p>`` with the current gradients (float64 here; the
        flat-buffer backends by the per-tile reduction of :meth:`block_energy`)."""
        dot = torch.zeros(len(self.blocks), dtype=torch.float64, device=self.device)
        for b, kept, g in self._named_grads():
            if g is not None:
                dot[b] += (kept.double() * g.double()).sum().to(self.device)
        return dot

    def block_dot_energy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_dot(), block_energy(False, 0.0))``, the same bits: the kept gradient's inner products with the
        gradients and the gradients' energies, per block. The kernel backends take both in one read of the
        buffers."""
        return self.block_dot(), self.block_energy(False, 0.0)

    @torch.no_grad()
    def orthogonalize_(self, coefficient: torch.Tensor) -> torch.Tensor:
        """``correction <- g - coefficient[b] * correction`` per block (float64 ``coefficient``, arithmetic in the
        compute dtype; ``g = 0`` where a parameter has no gradient), then its block energies
        ``sum_{p in b} ||correction_p||^2``, float64 ``[B]``."""
        energy = torch.zeros(len(self.blocks), dtype=torch.float64, device=self.device)
        for b, kept, g in self._named_grads():
            dtype = compute_dtype(kept)
            c = coefficient[b].to(device=kept.device, dtype=dtype)
            v = -c * kept.to(dtype) if g is None else g.to(dtype) - c * kept.to(dtype)
            kept.copy_(v)
            energy[b] += kept.double().square().sum().to(self.device)
        return energy

    @torch.no_grad()
    def add_correction_(self, correction_scale: torch.Tensor) -> None:
        """``g <- g + correction_scale[b] * correction`` in the gradients themselves, for a base optimizer that steps
        per tensor (parameters without a gradient keep none)."""
        for b, kept, g in self._named_grads():
            if g is not None:
                dtype = compute_dtype(g)
                s = correction_scale[b].to(device=g.device, dtype=dtype)
                g.copy_(g.to(dtype) + s * kept.to(dtype))

    # The SAM family's parts (gearsam_fused.family), per tensor as above; the flat-buffer backends run them per bucket.
    @torch.no_grad()
    def kept_energy(self) -> torch.Tensor:
        """float64 ``[B]``: ``sum_{p in b} ||correction_p||^2``, the energies of the kept gradient."""
        energy = torch.zeros(len(self.blocks), dtype=torch.float64, device=self.device)
        for b, kept, _ in self._named_grads():
            energy[b] += kept.double().square().sum().to(self.device)
        return energy

    @torch.no_grad()
    def mix_gradient_(self, grad_scale: torch.Tensor, kept_scale: torch.Tensor) -> None:
        """``g <- grad_scale[b] * g + kept_scale[b] * correction`` per block (float64 scales, arithmetic in the
        compute dtype); parameters without a gradient keep none."""
        for b, kept, g in self._named_grads():
            if g is not None:
                dtype = compute_dtype(g)
                a, c = (s[b].to(device=g.device, dtype=dtype) for s in (grad_scale, kept_scale))
                g.copy_(g.to(dtype) * a + kept.to(dtype) * c)

    @torch.no_grad()
    def exchange_sharpness_(self) -> None:
        """``g <- correction`` (the kept first gradient) and ``correction <- g - correction`` (the sharpness
        gradient), in the gradients' dtype; zero correction where a parameter has no gradient."""
        for _, kept, g in self._named_grads():
            if g is None:
                kept.zero_()
                continue
            sharpness = g - kept
            g.copy_(kept)
            kept.copy_(sharpness)

    @torch.no_grad()
    def add_kept_(self, group_scale: list[float]) -> None:
        """``w <- w + group_scale[group(p)] * correction_p`` for every parameter with a gradient (one ``add_`` per
        tensor)."""
        params = [p for block in self.blocks for p in block.params]
        for p, kept in zip(params, self.buffer_tensors(CORRECTION), strict=True):
            if p.grad is not None:
                scale = group_scale[self.param_group[id(p)]] if self.param_group is not None else group_scale[0]
                local(p).add_(kept, alpha=scale)

    @torch.no_grad()
    def friendly_ascent_(self, sigma: float, lmbda: float, started: Sequence[bool]) -> None:
        """F-SAM's ascent direction written into the gradients, per parameter with a gradient: where its EMA holds
        no gradient yet (``started[i]`` False, parameters in block order) ``m <- g`` (``g`` unchanged), as F-SAM's
        authors start it at a parameter's first gradient; else ``g <- g - sigma * m`` and
        ``m <- lerp(m, g_before, 1 - lmbda)``, in the gradients' dtype."""
        for (_, p, g), was_started in zip(self._params_and_grads(), started, strict=True):
            if g is not None:
                friendly_ascent(g, self._buffer(MOMENTUM, p), sigma, lmbda, first=not was_started)

    def friendly_energy_(self, sigma: float, lmbda: float, started: Sequence[bool], adaptive: bool,
                         eta: float) -> torch.Tensor:  # fmt: skip
        """:meth:`friendly_ascent_`, then :meth:`block_energy` of the ascent direction it leaves in the gradients (what
        the perturbation allocates by). The kernel backends take both in one read of each bucket where every
        parameter has a gradient and all or none of their EMAs have started, with these bits."""
        self.friendly_ascent_(sigma, lmbda, started)
        return self.block_energy(adaptive, eta)

    def buffer_tensors(self, name: str) -> list[torch.Tensor]:
        """The buffer ``name`` (one of :data:`BUFFERS`) as one tensor per parameter, in block order (zeros before
        first use)."""
        return [self._buffer(name, p) for block in self.blocks for p in block.params]

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of each of :data:`BUFFERS` (0 until first used)."""
        return {name: sum(t.nbytes for t in store.values()) for name, store in self._buffers.items()}

    def _with_buffers(self, report: dict[str, int]) -> dict[str, int]:
        """``report`` with each buffer's bytes under its name, and in ``total``."""
        buffers = self.buffer_bytes()
        return {**report, **buffers, "total": report["total"] + sum(buffers.values())}

    def _restore_and_update(self, updates: list, found_inf: torch.Tensor | None, mix: Mix | None = None,
                            momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        """:meth:`restore_and_update_`'s tensor work (``mix`` only where :attr:`folds_mix`)."""
        raise NotImplementedError(f"backend {self.name!r} does not fuse the base optimizer's step")

    def _perturb(self, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        """:meth:`perturb_`'s tensor work (a backend that :attr:`folds_keep` also takes ``keep``)."""
        raise NotImplementedError

    def _restore(self) -> None:
        """:meth:`restore_`'s tensor work."""
        raise NotImplementedError

    @torch.no_grad()
    def zero_grad_(self) -> None:
        """Zero every existing gradient in place (``zero_grad(set_to_none=False)``)."""
        grads = []
        for block in self.blocks:
            for p in block.params:
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    grads.append(p.grad)
        if grads:
            torch._foreach_zero_(grads)

    def memory_overhead(self) -> dict[str, int]:
        """Bytes this backend holds (at its peak within a step) beyond the parameters and their gradients; the
        correction buffer, once allocated, is in ``correction`` and in ``total``. Here, for the backends that leave
        every parameter where it is: a saved copy of each parameter with a gradient (of this rank's shard), held from
        ``perturb_`` to ``restore_`` and bounded by all of them; the flat-buffer backends count their buffers."""
        backup = sum(local(p).nbytes for block in self.blocks for p in block.params)
        return self._with_buffers({"backup": backup, "padding": 0, "tables": 0, "total": backup, "grad_buffer": 0})


def friendly_ascent(g: torch.Tensor, m: torch.Tensor, sigma: float, lmbda: float, first: bool) -> None:
    """:meth:`Backend.friendly_ascent_` on one gradient ``g`` and its EMA ``m`` (the operations F-SAM's authors use:
    a subtraction with ``alpha``, then ``lerp_`` towards the gradient before it)."""
    if first:
        m.copy_(g)
        return
    before = g.clone()
    g.sub_(m, alpha=sigma)
    m.lerp_(before, 1.0 - lmbda)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Arithmetic precision for elementwise work on ``t``: float64 stays float64, everything else runs in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
