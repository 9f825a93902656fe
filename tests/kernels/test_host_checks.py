"""The sync's ownership check in C++ (``csrc/host_checks.cpp``, ``Bucket.owns_every_tensor``): the answer it states
for every case the step meets, and without it (an install without the extension) the sync mends every change slot by
slot to the same bits."""

import copy

import pytest
import torch

from gearsam_fused import SAM
from gearsam_fused import flat as flat_layout

from conftest import SGD_KW, batches, flat, sam_step, tiny_resnet

owns_every_tensor = flat_layout._owns_every_tensor()
needs_check = pytest.mark.skipif(owns_every_tensor is None, reason="the C++ extension is not built")


def _params(n: int = 5):
    """``n`` parameters, views of one buffer, each with its gradient a view of another; and the views."""
    buffer, grads = torch.zeros(n * 8), torch.zeros(n * 8)
    params = [torch.nn.Parameter(buffer[8 * i : 8 * i + 8]) for i in range(n)]
    views = [grads[8 * i : 8 * i + 8] for i in range(n)]
    for p, g in zip(params, views):
        p.grad = g
    return params, [p.data_ptr() for p in params], views


@needs_check
def test_ownership_holds_exactly_when_every_address_and_gradient_is_the_given_one():
    params, addresses, grads = _params()
    assert owns_every_tensor(params, addresses, grads)
    assert owns_every_tensor([], [], [])
    for change in (
        lambda params, grads: setattr(params[-1], "data", params[-1].detach().clone()),  # other memory
        lambda params, grads: setattr(params[0], "grad", None),
        lambda params, grads: setattr(params[2], "grad", grads[2].detach()),  # another object over the same memory
        lambda params, grads: setattr(params[1], "grad", grads[1].clone()),
    ):
        params, addresses, grads = _params()
        change(params, grads)
        assert not owns_every_tensor(params, addresses, grads)
    params, addresses, grads = _params()
    shifted = [a + 4 for a in addresses]
    assert not owns_every_tensor(params, shifted, grads)
    assert not owns_every_tensor(params, addresses, grads[1:] + grads[:1])  # each its own gradient
    assert not owns_every_tensor(params, addresses, [*grads[:-1], "not a tensor"])


@needs_check
def test_arguments_of_the_wrong_kind_or_length_are_refused():
    params, addresses, grads = _params(3)
    with pytest.raises(ValueError, match=r"grads has 2 items where the parameters are 3"):
        owns_every_tensor(params, addresses, grads[:2])
    with pytest.raises(TypeError, match=r"addresses must be a list"):
        owns_every_tensor(params, tuple(addresses), grads)
    with pytest.raises(TypeError, match=r"params\[1\] is not a tensor"):
        owns_every_tensor([params[0], "x", params[2]], addresses, grads)


@needs_check
@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_a_run_that_replaces_tensors_and_state_gives_the_same_bits_without_the_check(base, monkeypatch):
    """The same steps, with a parameter's ``.data``, a gradient and the optimizer state replaced between them, with
    the C++ check and without it (the sync then tests every slot itself): the same bits."""
    cls, kw = (torch.optim.SGD, SGD_KW) if base == "sgd" else (torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2))
    results = []
    for check in (owns_every_tensor, None):
        monkeypatch.setattr(flat_layout, "_owns_every_tensor", lambda check=check: check)
        model = tiny_resnet()
        opt = SAM(model, cls, rho=0.05, backend="torch", base_step="fused", **kw)
        data = batches(5, seed=3)
        sam_step(opt, model, data[0])
        saved = copy.deepcopy(opt.state_dict())
        sam_step(opt, model, data[1])
        model.fc.weight.data = model.fc.weight.detach().clone()  # replaced: copied back in and re-homed
        sam_step(opt, model, data[2])
        opt.load_state_dict(copy.deepcopy(saved))  # the state replaced: adopted into the flat buffers
        sam_step(opt, model, data[3])
        sam_step(opt, model, data[4])
        results.append(flat(model))
    assert torch.equal(results[0], results[1])
