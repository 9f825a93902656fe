"""The Hessian probe against Hessians known exactly: a least-squares model (H = X^T X / n), and small networks whose
full Hessian torch.autograd.functional.hessian forms."""

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from gearsam_fused.analysis import hessian_eigenvalues, hessian_spectrum, hessian_trace, hessian_vector_product

from conftest import CUDA

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]),
]


def least_squares(device: str, d: int = 12, n: int = 64):
    """``(model, loss_fn, batches, H)``: 0.5 * mean (x . w - y)^2 over two batches, whose Hessian is X^T X / n,
    built with well-separated eigenvalues so that power iteration converges fast."""
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    spectrum = 2.0 ** -torch.arange(d, dtype=torch.float64) * 8.0  # 8, 4, 2, 1, ...
    x = u @ torch.diag((spectrum * n).sqrt()) @ v.T
    y = torch.randn(n, generator=g, dtype=torch.float64)
    model = nn.Linear(d, 1, bias=False).double().to(device)
    batches = [(x[: n // 2].to(device), y[: n // 2].to(device)), (x[n // 2 :].to(device), y[n // 2 :].to(device))]

    def loss_fn(m, batch):
        xb, yb = batch
        return 0.5 * (m(xb).squeeze(1) - yb).square().mean()

    return model, loss_fn, batches, (x.T @ x / n)


def small_network(device: str, batchnorm: bool = False):
    """``(model, loss_fn, batches, H)``: a tanh MLP (with BatchNorm in eval mode if asked) and its full Hessian."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(5))
    model = nn.Sequential(*layers).double().to(device)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64).to(device), torch.randint(0, 3, (8,), generator=g).to(device)) for _ in range(3)]  # fmt: skip

    def loss_fn(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    names = [n for n, p in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def mean_loss(w):
        pieces = torch.split(w, [math.prod(s) for s in shapes])
        params = {n: piece.reshape(s) for n, piece, s in zip(names, pieces, shapes)}
        return sum(loss_fn(lambda x: functional_call(model, params, (x,)), b) for b in batches) / len(batches)

    was_training = model.training
    model.eval()
    hessian = torch.autograd.functional.hessian(mean_loss, flat)
    model.train(was_training)
    return model, loss_fn, batches, hessian


def top_by_magnitude(hessian: torch.Tensor, k: int) -> list[float]:
    values = torch.linalg.eigvalsh(hessian)
    return sorted(values[values.abs().argsort(descending=True)[:k]].tolist(), reverse=True)


@pytest.mark.parametrize("device", DEVICES)
def test_least_squares_eigenvalues_are_exact(device):
    model, loss_fn, batches, hessian = least_squares(device)
    found = hessian_eigenvalues(model, loss_fn, batches, k=4, max_iter=200, tol=1e-10, seed=0)
    torch.testing.assert_close(torch.tensor(found), torch.tensor(top_by_magnitude(hessian, 4)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_hessian_vector_product_is_the_full_hessian_times_the_vector(device):
    model, loss_fn, batches, hessian = small_network(device)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(3)
    vector = [torch.randn(p.shape, generator=g, dtype=torch.float64).to(device) for p in params]
    model.eval()
    product = torch.cat([t.reshape(-1) for t in hessian_vector_product(model, loss_fn, batches, params, vector)])
    expected = hessian @ torch.cat([v.reshape(-1) for v in vector])
    torch.testing.assert_close(product, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batchnorm", [False, True], ids=["mlp", "batchnorm"])
def test_network_eigenvalues_match_the_full_hessian(device, batchnorm):
    model, loss_fn, batches, hessian = small_network(device, batchnorm)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    found = hessian_eigenvalues(model, loss_fn, batches, k=3, max_iter=500, tol=1e-10, seed=0)
    torch.testing.assert_close(torch.tensor(found), torch.tensor(top_by_magnitude(hessian, 3)), rtol=1e-5, atol=1e-9)
    assert model.training and all(m.training for m in model.modules())  # the mode is given back
    for key, value in model.state_dict().items():  # BatchNorm's running statistics are untouched
        assert torch.equal(value, before[key]), key


def test_same_seed_same_result_and_seeds_differ_only_by_convergence():
    model, loss_fn, batches, hessian = small_network("cpu")
    first = hessian_eigenvalues(model, loss_fn, batches, k=2, max_iter=5, seed=7)
    assert first == hessian_eigenvalues(model, loss_fn, batches, k=2, max_iter=5, seed=7)
    assert first != hessian_eigenvalues(model, loss_fn, batches, k=2, max_iter=5, seed=8)  # 5 steps: not converged


def test_trace_is_exact_for_a_diagonal_hessian():
    """For H = diag(a) every Rademacher sample gives z . H z = sum(a) exactly."""
    weights = torch.tensor([0.5, 2.0, 3.0, 7.0], dtype=torch.float64)
    model = nn.Linear(4, 1, bias=False).double()

    def loss_fn(m, _):
        return 0.5 * (weights * m.weight.square().squeeze(0)).sum()

    assert hessian_trace(model, loss_fn, [None], samples=3, seed=0) == pytest.approx(weights.sum().item(), rel=1e-12)


def test_trace_estimate_is_within_its_standard_error():
    """Hutchinson's variance for Rademacher vectors is 2 * sum_{i != j} H_ij^2 per sample; the seeded estimate lies
    within four standard errors of the exact trace (a fixed seed: the outcome is the same at every run)."""
    model, loss_fn, batches, hessian = least_squares("cpu")
    samples = 400
    off_diagonal = hessian.square().sum() - hessian.diagonal().square().sum()
    standard_error = math.sqrt(2 * off_diagonal.item() / samples)
    estimate = hessian_trace(model, loss_fn, batches, samples=samples, seed=0)
    assert abs(estimate - hessian.trace().item()) <= 4 * standard_error


def test_bad_arguments_are_named():
    model, loss_fn, batches, _ = least_squares("cpu", d=3)
    with pytest.raises(ValueError, match="k must be a positive int, got 0"):
        hessian_eigenvalues(model, loss_fn, batches, k=0)
    with pytest.raises(ValueError, match="k=4 eigenvalues asked of a Hessian of size 3"):
        hessian_eigenvalues(model, loss_fn, batches, k=4)
    with pytest.raises(ValueError, match="batches must be a non-empty sequence"):
        hessian_eigenvalues(model, loss_fn, [])
    with pytest.raises(ValueError, match="tol must lie in"):
        hessian_eigenvalues(model, loss_fn, batches, tol=0)
    with pytest.raises(ValueError, match="samples must be a positive int, got 0"):
        hessian_trace(model, loss_fn, batches, samples=0)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        hessian_trace(lambda x: x, loss_fn, batches)
    model.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        hessian_trace(model, loss_fn, batches)


def test_spectrum_reports_how_far_each_eigenvalue_converged():
    model, loss_fn, batches, hessian = least_squares("cpu")
    expected = top_by_magnitude(hessian, 2)
    done = hessian_spectrum(model, loss_fn, batches, 2, max_iter=200, tol=1e-10)
    assert done.eigenvalues == hessian_eigenvalues(model, loss_fn, batches, 2, max_iter=200, tol=1e-10)
    assert done.eigenvalues == pytest.approx(expected, rel=1e-6) and done.converged == [True, True]
    assert all(r < 1e-3 for r in done.residuals) and all(1 < i <= 200 for i in done.iterations)
    cut = hessian_spectrum(model, loss_fn, batches, 2, max_iter=1)  # one product: no second value to compare
    assert cut.converged == [False, False] and cut.iterations == [1, 1]
    assert all(r > 0.05 for r in cut.residuals)  # a random start is no eigenvector: the residual says so
    assert len(cut.eigenvalues) == len(cut.residuals) == 2
