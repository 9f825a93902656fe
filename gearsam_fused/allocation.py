"""Radius allocation over blocks: the O(B) part of a step, shared by every backend.

All inputs and outputs are float64 tensors of shape ``[B]`` on one device. Nothing here reads a value back to the
host, so a step stays free of synchronisation on CUDA. Float64 is used because these vectors are tiny (one entry per
block) and the EMA is carried across the whole run: rounding it to float32 every step would make a resumed or
re-partitioned run drift for no speed gain.

The rule names below are the one spelling of each method wherever a program names it: the ``rule`` of
:class:`~gearsam_fused.SAM` and :class:`~gearsam_fused.GEARSAM`, their state-dict tag, the ``gearsam`` command's
``--optimizers`` and its metrics rows. Kernels never see the names: they are told ``gear=True`` or ``False``.
"""

from __future__ import annotations

import torch

#: SAM's rule: one global scale (SAM and ASAM).
SAM_RULE = "sam"
#: GEAR-SAM's rule: the radius split across blocks by the EMA of their energies.
GEAR_RULE = "gear-sam"
#: Every allocation rule, as :func:`allocate` accepts it.
RULES = (SAM_RULE, GEAR_RULE)


def check_rule(rule: str) -> str:
    """``rule`` if it names an allocation rule, else a ValueError listing them."""
    if rule not in RULES:
        raise ValueError(f"unknown allocation rule {rule!r}; expected one of {RULES}")
    return rule


def _safe_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``den > 0``, else 0 (without ever dividing by zero, so no NaN enters a branch)."""
    positive = den > 0
    return torch.where(positive, num / torch.where(positive, den, torch.ones_like(den)), torch.zeros_like(num))


def _unit(s: torch.Tensor) -> torch.Tensor:
    """``s / ||s||_2`` for ``s >= 0`` (0 when ``s = 0``), through ``t = s / max_b s_b``.

    Squaring ``s`` directly would underflow to a zero norm below ~1e-154 and overflow above ~1e154, ordinary float64
    energies for tiny or huge gradients; ``t`` lies in ``[0, 1]`` with a largest entry of exactly 1, so ``||t||`` is
    in ``[1, sqrt(B)]``.
    """
    peak = s.amax() if s.numel() else s.new_zeros(())
    t = _safe_ratio(s, peak)
    return _safe_ratio(t, torch.linalg.vector_norm(t))


def _finite(value: torch.Tensor, found_inf: torch.Tensor | None) -> torch.Tensor:
    """Where ``value`` is finite and no overflow was found (``found_inf``: a one-element tensor, nonzero when the
    step's gradients overflowed under loss scaling, which skips the whole step)."""
    finite = value.isfinite()
    return finite if found_inf is None else finite & (found_inf.reshape(()) == 0)


def gear_allocate(
    energy: torch.Tensor, ema: torch.Tensor, rho: float | torch.Tensor, beta: float, delta: float,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """GEAR-SAM allocation (paper Eq. ema_energy, Prop. 1 and the stabilised direction).

    Updates ``ema`` in place, then returns ``(scale, radius)``::

        s_b   <- beta * s_b + (1 - beta) * e_b  (kept as it was when e_b is not finite)
        r_b    = rho * s_b / ||s||_2            (all zero when s = 0; the norm is taken of s / max_b s_b)
        scale_b = r_b / (sqrt(e_b) + delta)     so that eps_b = scale_b * g_b

    and ``r_b = scale_b = 0`` for a block whose energy is not finite: one inf or NaN gradient skips its block for one
    step instead of entering the EMA, which would zero every later radius. ``sum_b r_b**2 == rho**2`` whenever
    ``s != 0`` and every energy is finite, and ``||eps|| <= rho`` always. Where ``found_inf`` is set, every block is
    skipped so. ``rho`` may be a float64 0-d tensor (``capturable=True``): the same operations, the same bits.
    """
    finite = _finite(energy, found_inf)
    ema.copy_(torch.where(finite, (ema * beta).add_(energy, alpha=1.0 - beta), ema))
    radius = torch.where(finite, rho * _unit(ema), 0.0)
    scale = torch.where(finite, radius / (energy.sqrt() + delta), 0.0)
    return scale, radius


def sam_allocate(
    energy: torch.Tensor, rho: float | torch.Tensor, delta: float, found_inf: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """SAM as a block allocation (paper Obs. 1): one global scale, and the radii it implies per block.

    Returns ``(scale, radius)``::

        scale_b  = rho / (sqrt(sum_j e_j) + delta)          the same for every block
        r_b      = rho * sqrt(e_b) / sqrt(sum_j e_j)        (all zero when the gradient is zero)

    and every ``scale_b = r_b = 0`` when the total energy is not finite or ``found_inf`` is set (no perturbation that
    step). ``scale`` is exactly what the common SAM implementation uses, so results match it; ``radius`` is telemetry.
    """
    total = energy.sum()
    finite = _finite(total, found_inf)
    norm = total.sqrt()
    scale = torch.where(finite, rho / (norm + delta), 0.0).expand_as(energy).clone()
    radius = torch.where(finite, rho * _safe_ratio(energy.sqrt(), norm), 0.0)
    return scale, radius


def allocate(
    rule: str, energy: torch.Tensor, ema: torch.Tensor, rho: float | torch.Tensor, beta: float, delta: float,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(scale, radius)`` by ``rule``: :func:`gear_allocate` (which updates ``ema``) or :func:`sam_allocate`."""
    if check_rule(rule) == GEAR_RULE:
        return gear_allocate(energy, ema, rho, beta, delta, found_inf)
    return sam_allocate(energy, rho, delta, found_inf)
