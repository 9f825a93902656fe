"""The contract every backend implements: four operations over an ordered list of parameter blocks.

The optimizer frontend owns the algorithm (which energies, which allocation rule, when to restore); a backend owns
only how the tensor work is done. Between :meth:`perturb_` and :meth:`restore_` the parameters hold ``w + eps``.
"""

from __future__ import annotations

import torch


class Backend:
    """Base class. ``blocks[b]`` is the list of parameters of block ``b``; ``device`` receives the energies."""

    name = "abstract"

    def __init__(self, blocks: list[list[torch.Tensor]], device: torch.device):
        self.blocks = blocks
        self.device = device

    def block_energy(self, adaptive: bool, eta: float) -> torch.Tensor:
        """float64 ``[B]`` on ``self.device``: ``e_b = sum_{p in b} ||T_p * g_p||^2`` with ``T_p = |p| + eta`` if
        ``adaptive`` else 1. Parameters whose ``grad`` is None contribute nothing."""
        raise NotImplementedError

    def perturb_(self, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        """Save every parameter that has a gradient, then ``p += scale[b] * T_p**2 * g_p`` in place."""
        raise NotImplementedError

    def restore_(self) -> None:
        """Put back, bit for bit, every parameter saved by the last :meth:`perturb_`."""
        raise NotImplementedError


def checked_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad``, refusing layouts the SAM step cannot handle."""
    g = p.grad
    if g is not None and g.layout != torch.strided:
        raise TypeError(
            f"SAM does not support sparse gradients (parameter of shape {tuple(p.shape)} has a {g.layout} grad); "
            "use a dense embedding (sparse=False)"
        )
    return g


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Arithmetic precision for elementwise work on ``t``: float64 stays float64, everything else runs in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
