"""A finite gradient whose float32 squares overflow: the fused backends perturb as the reference does.

One gradient element of 2e19 lies above the square root of FLT_MAX (about 1.8e19): its float32 square is infinite,
while the block's energy, a float64, is 4e38. The fused backends once squared in float32, so SAM perturbed nothing
and GEAR-SAM skipped the block and counted it in ``block_stats()['non_finite']``, though every value was finite. The
kernel-level cases (every dtype, ASAM, the other energies) are in ``tests/kernels/test_energy_overflow.py``.
"""

import pytest
import torch
from torch import nn

from gearsam_fused import GEARSAM, SAM

from conftest import FUSED

# Triton's interpreter computes with numpy, which warns where float32 overflows: here on purpose.
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)


def _first_step(cls, backend: str, device: str):
    """A Linear(4, 2) whose weight's gradient holds 2e19, after first_step: the perturbation of each parameter and
    block_stats()."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = cls(model, torch.optim.SGD, rho=0.05, lr=0.1, backend=backend, partition="tensor")
    model(torch.randn(3, 4, device=device)).sum().backward()
    with torch.no_grad():
        model.weight.grad[0, 0] = 2e19
    before = [p.detach().clone() for p in model.parameters()]
    opt.first_step()
    return [p.detach() - w for p, w in zip(model.parameters(), before, strict=True)], opt.block_stats()


@pytest.mark.parametrize("backend,device", FUSED)
@pytest.mark.parametrize("cls", [SAM, GEARSAM], ids=["sam", "gear-sam"])
def test_a_gradient_past_the_square_root_of_flt_max_is_perturbed_as_the_reference_does(backend, device, cls):
    eps, stats = _first_step(cls, backend, device)
    expected_eps, expected = _first_step(cls, "reference", device)
    assert int(stats["non_finite"]) == 0 and torch.isfinite(stats["energy"]).all(), stats
    assert (stats["radius"] > 0).all()
    for key in ("energy", "radius", "share"):
        torch.testing.assert_close(stats[key], expected[key], rtol=1e-6, atol=0)
    for got, want in zip(eps, expected_eps, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert eps[0][0, 0] > 0.04  # the large element moved by about rho; before, by nothing
