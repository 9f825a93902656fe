"""The SAM family as choices of one step's parts: the one mechanism behind every variant the library ships.

A sharpness-aware step takes the gradient ``g`` at ``w``, turns an **ascent direction** ``d`` into the perturbation
``eps`` by a **radius allocation**, takes the gradient ``h`` at ``w + eps``, and lets the base optimizer step from
``w`` with a **descent gradient** built from ``h`` (and ``g``)::

    ascent      d = g                                           SAM, GEAR-SAM
                d = g - sigma * m,  m <- lerp(m, g, 1 - lmbda)  FriendlyAscent (F-SAM; m = g on the first step)
    allocation  one global scale, or GEAR-SAM's block-wise EMA  the optimizer's rule (SAM / GEARSAM)
    descent     h                                               SAM, GEAR-SAM
                h - alpha * (g - c * h)                         SurrogateGap (GSAM), c = cos(g, h) ||g|| / ||h||
                a * h + (1 - a) * g                             WeightedSharpness (WSAM), a = gamma / (1 - gamma);
                or, decoupled: the base step with g, then w <- w - lr * a * (h - g)

``cos(g, h) = <g, h> / (||h|| ||g|| + eps)`` and ``c = cos(g, h) ||g|| / (||h|| + eps)``, as GSAM's authors compute
them. Under SAM's rule the inner products and norms of the descent are over the whole gradient; under GEAR-SAM's,
per block, as the allocation is. :class:`~gearsam_fused.GSAM`, :class:`~gearsam_fused.WSAM` and
:class:`~gearsam_fused.FriendlySAM` are SAM with one part chosen; :class:`~gearsam_fused.GEARSAM` and
:class:`~gearsam_fused.SAM` take the same parts as ``ascent=`` and ``descent=``, so that GEAR-SAM's allocation
composes with any of them (``GEARSAM(model, SGD, descent=SurrogateGap(0.1))``).

The parts run as backend operations over the flat buffers (:class:`~gearsam_fused.backends.base.Backend`:
``keep_gradient_``, ``block_dot_energy``, ``kept_energy``, ``mix_gradient_``, ``exchange_sharpness_``, ``add_kept_``,
``friendly_energy_``), each a pass of its own beside the step's kernels but those the kernel backends (``cpp``,
``triton``) fold into the step's own passes: the perturbation keeps ``g`` as it reads it (``Backend.perturb_(...,
keep=True)``, where no ascent has replaced ``g`` before), and the descent, a :class:`Mix` (per-block coefficients of
``h`` and ``g``, and for the decoupled WSAM the weight of its sharpness step), is taken by the fused base step as it
reads the gradients (``Backend.restore_and_update_(..., mix=)``; the gradients then keep ``h``). The other backends,
or a base step taken per tensor, run ``keep_gradient_``, ``mix_gradient_``, and for the decoupled WSAM
``exchange_sharpness_`` before the base step and ``add_kept_`` (torch operations) after it, as passes. On the kernel
backends the inner product and the norms are the energy kernel's deterministic per-tile reduction (``block_energy``,
with ``other`` for ``<g, h>`` beside ``||h||^2`` in one read), WSAM's exchange is a kernel of its own
(``exchange_sharpness_``), and F-SAM's ascent is taken in the energy pass: one read of ``g`` and ``m`` writes the
direction and the new ``m`` and sums the direction's energies (``friendly_energy_``, where every parameter of a bucket
has a gradient and all or none of their EMAs start this step; else ``friendly_ascent_`` on each run of parameters with
one, then ``block_energy``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .checks import check_real

Reduce = Callable[[torch.Tensor], torch.Tensor]  # a [B] vector summed over the ranks that hold shards of a block


class FriendlyAscent:
    """F-SAM's ascent direction (Li et al., "Friendly Sharpness-Aware Minimization", CVPR 2024): the gradient minus
    ``sigma`` times an EMA ``m`` of past gradients (decay ``lmbda``), the component that full-batch gradients share,
    which the authors find adds nothing to generalisation. A parameter's first gradient starts its ``m = g`` and is
    its ascent direction as it is (per parameter, as the authors' code and pytorch_optimizer start it: one whose
    first gradient comes late starts then). ``first_step`` leaves ``d`` in the parameters' ``.grad``. A
    ``first_step(cancellable=True)`` (``SAMScaler``, ``distributed.sam_step``) keeps a copy of ``m`` until the step
    completes, so that ``cancel_step()`` puts it back."""

    #: the backend operations it runs (:attr:`~gearsam_fused.backends.base.Backend.family_operators`)
    operations = ("friendly_energy_",)

    def __init__(self, sigma: float = 1.0, lmbda: float = 0.9):
        self.sigma = check_real("sigma", sigma, low=0.0)
        self.lmbda = check_real("lmbda", lmbda, low=0.0, high=1.0, high_inclusive=True)

    def __repr__(self) -> str:
        return f"FriendlyAscent(sigma={self.sigma!r}, lmbda={self.lmbda!r})"

    def apply_(self, backend, started: Sequence[bool], adaptive: bool, eta: float) -> torch.Tensor:
        """Replace the gradients by the ascent direction (and update ``m``; ``started``: per parameter in block order,
        whether its ``m`` holds a gradient yet); the direction's block energies (ASAM's with ``adaptive``), which the
        kernel backends take in the same read."""
        return backend.friendly_energy_(self.sigma, self.lmbda, started, adaptive, eta)


class Mix(NamedTuple):
    """A descent gradient as per-block coefficients of the gradients ``h`` and the kept first gradient ``g``, float64
    ``[B]`` each: ``grad_scale[b] * h + kept_scale[b] * g``
    (:meth:`~gearsam_fused.backends.base.Backend.mix_gradient_`); and ``sharpness``, a weight ``a`` for the step after
    the update, ``w <- w - lr * a * (h - g)`` (WSAM's decoupled sharpness step), 0 for none, which only the fused base
    step of the kernel backends takes (:attr:`~gearsam_fused.backends.base.Backend.folds_mix`)."""

    grad_scale: torch.Tensor
    kept_scale: torch.Tensor
    sharpness: float = 0.0

    def to(self, device: torch.device) -> Mix:
        """The same mix with its scales on ``device``."""
        return self._replace(grad_scale=self.grad_scale.to(device), kept_scale=self.kept_scale.to(device))


class Descent:
    """A descent gradient other than ``h``: the first gradient is kept from ``first_step`` (the backend's
    correction buffer), :meth:`before_update` says how the base optimizer's update takes it (or rewrites the
    gradients itself) and :meth:`after_update` may change the weights after it."""

    #: the backend operations it runs, the first gradient's keeping among them
    #: (:attr:`~gearsam_fused.backends.base.Backend.family_operators`)
    operations: tuple[str, ...] = ("keep_gradient_",)
    #: those it runs besides, only where the base update does not take its mix (``folds`` False)
    unfolded_operations: tuple[str, ...] = ()

    def before_update(self, backend, reduce: Reduce, per_block: bool, first_energy: torch.Tensor | None = None,
                      folds: bool = False) -> Mix | None:  # fmt: skip
        """The descent gradient as a :class:`Mix` of ``h`` and ``g``, which the base update takes (in its own pass on
        the kernel backends, whose fused step computes it as it reads the gradients), or None after rewriting the
        gradients into it here. ``first_energy``: the first gradient's block energies, summed over the ranks, where
        the step already took them (its energy pass over ``g`` itself: no ascent, no ASAM scaling), so that they need
        not be taken again from the kept gradient; None otherwise. ``folds``: whether the base update takes the mix
        in its own pass (a kernel backend's fused step), the only one that takes a ``sharpness``."""
        raise NotImplementedError

    def after_update(self, backend, param_groups: list[dict], folds: bool = False) -> None:
        """Nothing, unless the variant steps after the base optimizer (``folds`` as for :meth:`before_update`)."""

    def check_groups(self, param_groups: list[dict], base_name: str) -> None:
        """Raise ``ValueError`` if the base optimizer's ``param_groups`` lack what :meth:`after_update` reads."""


def _over_rule(values: torch.Tensor, per_block: bool) -> torch.Tensor:
    """``values`` per block (GEAR-SAM's rule), or their sum in every entry (SAM's)."""
    return values if per_block else values.sum().expand_as(values)


class SurrogateGap(Descent):
    """GSAM's descent (Zhuang et al., "Surrogate Gap Guided Sharpness-Aware Minimization", ICLR 2022): ``h`` minus
    ``alpha`` times the part of ``g`` orthogonal to ``h``, which decreases the surrogate gap ``L(w + eps) - L(w)``
    without changing the descent along ``h``. ``eps`` stabilises the two divisions (GSAM's ``perturb_eps``)."""

    operations = ("keep_gradient_", "block_dot_energy", "kept_energy", "mix_gradient_")

    def __init__(self, alpha: float = 0.4, eps: float = 1e-12):
        self.alpha = check_real("alpha", alpha, low=0.0, high=1.0, high_inclusive=True)
        self.eps = check_real("eps", eps, low=0.0)

    def __repr__(self) -> str:
        return f"SurrogateGap(alpha={self.alpha!r}, eps={self.eps!r})"

    def before_update(self, backend, reduce: Reduce, per_block: bool, first_energy: torch.Tensor | None = None,
                      folds: bool = False) -> Mix:  # fmt: skip
        dot, h_energy = reduce(torch.stack(backend.block_dot_energy())).unbind(0)  # <g, h> and ||h||^2, one pass
        dot = _over_rule(dot, per_block)
        h_norm = _over_rule(h_energy, per_block).sqrt()
        g_energy = reduce(backend.kept_energy()) if first_energy is None else first_energy  # the same kernel, g's bits
        g_norm = _over_rule(g_energy, per_block).sqrt()
        cosine = dot / (h_norm * g_norm + self.eps)
        c = cosine * g_norm / (h_norm + self.eps)
        return Mix(1.0 + self.alpha * c, torch.full_like(c, -self.alpha))


class WeightedSharpness(Descent):
    """WSAM's descent (Yue et al., "Sharpness-Aware Minimization Revisited: Weighted Sharpness as a Regularization
    Term", KDD 2023): the loss plus ``gamma / (1 - gamma)`` times the sharpness ``L(w + eps) - L(w)``, whose gradient
    is ``a * h + (1 - a) * g``. ``decouple=True`` (the authors' default) steps the base optimizer with ``g`` and
    then takes the sharpness term as a plain gradient step, ``w <- w - lr * a * (h - g)`` per param group: in the
    fused base step's own pass on the kernel backends (a :class:`Mix` of ``0 * h + 1 * g`` with ``sharpness=a``:
    the same bits as the two passes where ``h`` is finite, a zero's sign aside), else by exchanging ``h`` and ``g``
    before the base step and adding the kept ``h - g`` after it."""

    def __init__(self, gamma: float = 0.9, decouple: bool = True):
        self.gamma = check_real("gamma", gamma, low=0.0, high=1.0)
        if not isinstance(decouple, bool):
            raise TypeError(f"decouple must be a bool, got {decouple!r}")
        self.decouple = decouple
        self.weight = self.gamma / (1.0 - self.gamma)

    def __repr__(self) -> str:
        return f"WeightedSharpness(gamma={self.gamma!r}, decouple={self.decouple!r})"

    @property
    def operations(self) -> tuple[str, ...]:
        return ("keep_gradient_",) if self.decouple else ("keep_gradient_", "mix_gradient_")

    @property
    def unfolded_operations(self) -> tuple[str, ...]:
        return ("exchange_sharpness_", "add_kept_") if self.decouple else ()

    def before_update(self, backend, reduce: Reduce, per_block: bool, first_energy: torch.Tensor | None = None,
                      folds: bool = False) -> Mix | None:  # fmt: skip
        if self.decouple and not folds:
            backend.exchange_sharpness_()  # the gradients hold g, the kept buffer h - g
            return None
        n = len(backend.blocks)
        full = lambda v: torch.full((n,), v, dtype=torch.float64, device=backend.device)  # noqa: E731
        if self.decouple:
            return Mix(full(0.0), full(1.0), self.weight)
        return Mix(full(self.weight), full(1.0 - self.weight))

    def after_update(self, backend, param_groups: list[dict], folds: bool = False) -> None:
        if self.decouple and not folds:
            backend.add_kept_([-group["lr"] * self.weight for group in param_groups])

    def check_groups(self, param_groups: list[dict], base_name: str) -> None:
        if self.decouple and any("lr" not in group for group in param_groups):
            raise ValueError(
                f"{self!r} takes the sharpness step with each param group's lr, and {base_name}'s param groups have "
                "none; use decouple=False or a base optimizer with a learning rate"
            )


def check_ascent(ascent) -> FriendlyAscent | None:
    if ascent is not None and not isinstance(ascent, FriendlyAscent):
        raise TypeError(f"ascent must be None or a FriendlyAscent, got {ascent!r}")
    return ascent


def check_descent(descent) -> Descent | None:
    if descent is not None and not isinstance(descent, Descent):
        raise TypeError(f"descent must be None, a SurrogateGap or a WeightedSharpness, got {descent!r}")
    return descent
