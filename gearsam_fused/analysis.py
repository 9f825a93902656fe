"""Curvature of a trained model's loss: the Hessian's dominant eigenvalues and its trace, from Hessian-vector products.

The Hessian ``H`` is that of ``L(w) = mean_j loss_fn(model, batches[j])`` with respect to the model's trainable
parameters ``w``, never formed: each product ``H v`` is one double backward per batch (Pearlmutter's trick,
``H v = d/dw (g(w) . v)``), as PyHessian computes it.

- :func:`hessian_eigenvalues`: power iteration with deflation. The ``i``-th eigenpair is found by iterating
  ``v <- P_i H v / ||P_i H v||``, ``P_i`` projecting out the ``i - 1`` eigenvectors already found, from a random start
  drawn from ``seed``, until the Rayleigh quotient ``v . H v`` changes by less than ``tol`` relative. It converges to
  the eigenvalues of largest magnitude.
- :func:`hessian_spectrum`: the same eigenvalues with how far each got: its residual ``||H v - lambda v|| / |lambda|``,
  the Hessian-vector products spent and whether the tolerance was met within ``max_iter`` (an eigenvalue cut off by
  ``max_iter`` can be far from the true one, and nothing else says so).
- :func:`hessian_trace`: Hutchinson's estimator ``tr H = E[z . H z]`` over Rademacher vectors ``z``.

The model is put in eval mode for the probe (BatchNorm uses its running statistics and leaves them untouched,
dropout is off) and given back in the mode it was in. Vectors live on the parameters' devices in their dtypes;
dot products are accumulated in float64.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .checks import check_real

__all__ = ["HessianSpectrum", "hessian_eigenvalues", "hessian_spectrum", "hessian_trace", "hessian_vector_product"]

LossFn = Callable[[nn.Module, object], torch.Tensor]


@dataclass(frozen=True)
class HessianSpectrum:
    """:func:`hessian_spectrum`'s result, each list in the order of ``eigenvalues`` (largest first)."""

    eigenvalues: list[float]
    #: ``||P H v - lambda v|| / |lambda|`` of each eigenpair's last iterate ``v`` (``P``: the deflation); 0 for an
    #: exact eigenvector
    residuals: list[float]
    #: Hessian-vector products spent on each eigenvalue
    iterations: list[int]
    #: whether each eigenvalue's relative change fell to ``tol`` within ``max_iter`` products
    converged: list[bool]


def hessian_eigenvalues(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Sequence,
    k: int = 1,
    *,
    max_iter: int = 100,
    tol: float = 1e-4,
    seed: int = 0,
) -> list[float]:
    """The ``k`` eigenvalues of largest magnitude of the Hessian of the mean of ``loss_fn(model, batch)`` over
    ``batches``, sorted from largest to smallest. Each takes at most ``max_iter`` Hessian-vector products; the same
    ``seed`` gives the same result. :func:`hessian_spectrum` also says whether each converged."""
    return hessian_spectrum(model, loss_fn, batches, k, max_iter=max_iter, tol=tol, seed=seed).eigenvalues


def hessian_spectrum(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Sequence,
    k: int = 1,
    *,
    max_iter: int = 100,
    tol: float = 1e-4,
    seed: int = 0,
) -> HessianSpectrum:
    """:func:`hessian_eigenvalues` (the same values for the same arguments) with each eigenvalue's residual, the
    products it took and whether it converged."""
    params = _trainable(model)
    _check_probe(batches, k=k, max_iter=max_iter)
    check_real("tol", tol, low=0.0, low_inclusive=False, high=1.0)
    size = sum(p.numel() for p in params)
    if k > size:
        raise ValueError(f"k={k} eigenvalues asked of a Hessian of size {size}")
    generator = torch.Generator().manual_seed(seed)
    found: list[list[torch.Tensor]] = []
    pairs = []
    with _eval_mode(model):
        for _ in range(k):
            value, vector, residual, iterations, converged = _power_iteration(
                model, loss_fn, batches, params, found, generator, max_iter, tol
            )
            pairs.append((value, residual, iterations, converged))
            found.append(vector)
    pairs.sort(key=lambda pair: pair[0], reverse=True)
    return HessianSpectrum(*(list(column) for column in zip(*pairs)))


def hessian_trace(model: nn.Module, loss_fn: LossFn, batches: Sequence, *, samples: int = 100, seed: int = 0) -> float:
    """Hutchinson's estimate of the trace of the same Hessian as :func:`hessian_eigenvalues`, averaged over
    ``samples`` Rademacher vectors drawn from ``seed``; exact for a diagonal Hessian."""
    params = _trainable(model)
    _check_probe(batches, samples=samples)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    with _eval_mode(model):
        for _ in range(samples):
            z = [(torch.randint(0, 2, p.shape, generator=generator) * 2 - 1).to(p) for p in params]
            total += _dot(z, hessian_vector_product(model, loss_fn, batches, params, z))
    return total / samples


def hessian_vector_product(
    model: nn.Module, loss_fn: LossFn, batches: Sequence, params: list[torch.Tensor], vector: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``H v`` for the Hessian of the mean loss over ``batches`` with respect to ``params``, one tensor per
    parameter."""
    product = [torch.zeros_like(p) for p in params]
    for batch in batches:
        loss = loss_fn(model, batch)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        inner = sum((g * v).sum() for g, v in zip(grads, vector))
        for total, part in zip(product, torch.autograd.grad(inner, params)):
            total.add_(part, alpha=1.0 / len(batches))
    return product


def _power_iteration(model, loss_fn, batches, params, found, generator, max_iter: int, tol: float):
    """``(eigenvalue, eigenvector, residual, iterations, converged)`` of the dominant eigenpair of ``H`` restricted to
    the complement of ``found``."""
    vector = _normalized(_deflated([torch.randn(p.shape, generator=generator).to(p) for p in params], found))
    value, converged, iterations = None, False, 0
    while iterations < max_iter:
        iterations += 1
        product = _deflated(hessian_vector_product(model, loss_fn, batches, params, vector), found)
        previous, value = value, _dot(vector, product)
        # the residual of the iterate whose Rayleigh quotient is ``value``: free, from the product just taken
        error = [p - value * v for p, v in zip(product, vector)]
        residual = math.sqrt(_dot(error, error)) / (abs(value) + 1e-30)
        vector = _normalized(product)
        if previous is not None and abs(value - previous) <= tol * (abs(previous) + 1e-12):
            converged = True
            break
    return value, vector, residual, iterations, converged


def _deflated(vector: list[torch.Tensor], found: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """``vector`` with its components along the (orthonormal) eigenvectors in ``found`` removed."""
    for basis in found:
        overlap = _dot(vector, basis)
        vector = [v - overlap * b for v, b in zip(vector, basis)]
    return vector


def _normalized(vector: list[torch.Tensor]) -> list[torch.Tensor]:
    norm = math.sqrt(_dot(vector, vector))
    return [v / norm for v in vector] if norm > 0 else vector


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(sum(torch.sum(x.double() * y.double()).item() for x, y in zip(a, b)))


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters: there is no Hessian to probe")
    return params


def _check_probe(batches: Sequence, **counts: int) -> None:
    """ValueError unless ``batches`` is a non-empty sequence and every one of ``counts`` a positive int."""
    if isinstance(batches, torch.Tensor) or not isinstance(batches, Sequence) or not batches:
        raise ValueError("batches must be a non-empty sequence (a list of batches, each passed to loss_fn)")
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Eval mode inside, each module's own mode given back after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.train(training)
