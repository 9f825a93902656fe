"""The host's checks (gearsam_fused.host_checks): each implementation, C++ and Python, gives the answer the checks
state for every case the step meets, and a run gives the same bits whichever one made its checks."""

import copy

import pytest
import torch

from gearsam_fused import SAM, host_checks

from conftest import SGD_KW, batches, flat, sam_step, tiny_resnet


def _params(n: int = 5):
    """``n`` parameters, views of one buffer, each with its gradient a view of another; and the views."""
    buffer, grads = torch.zeros(n * 8), torch.zeros(n * 8)
    params = [torch.nn.Parameter(buffer[8 * i : 8 * i + 8]) for i in range(n)]
    views = [grads[8 * i : 8 * i + 8] for i in range(n)]
    for p, g in zip(params, views):
        p.grad = g
    return params, [p.data_ptr() for p in params], views


def test_ownership_holds_exactly_when_every_address_and_gradient_is_the_given_one(host_checks_in):
    params, addresses, grads = _params()
    assert host_checks.in_use() == host_checks_in
    assert host_checks.owns_every_tensor(params, addresses, grads)
    assert host_checks.owns_every_tensor([], [], [])
    for change in (
        lambda params, grads: setattr(params[-1], "data", params[-1].detach().clone()),  # other memory
        lambda params, grads: setattr(params[0], "grad", None),
        lambda params, grads: setattr(params[2], "grad", grads[2].detach()),  # another object over the same memory
        lambda params, grads: setattr(params[1], "grad", grads[1].clone()),
    ):
        params, addresses, grads = _params()
        change(params, grads)
        assert not host_checks.owns_every_tensor(params, addresses, grads)
    params, addresses, grads = _params()
    shifted = [a + 4 for a in addresses]
    assert not host_checks.owns_every_tensor(params, shifted, grads)
    assert not host_checks.owns_every_tensor(params, addresses, grads[1:] + grads[:1])  # each its own gradient
    assert not host_checks.owns_every_tensor(params, addresses, [*grads[:-1], "not a tensor"])


def test_the_state_entries_are_found_by_identity(host_checks_in):
    params, _, _ = _params(6)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    entries = {p: {"momentum_buffer": torch.zeros(8)} for p in params[1:5]}
    stranger = torch.zeros(8)
    opt.state.update(entries)
    opt.state[stranger] = {"x": 1}  # not one of the asked parameters
    asked = [params[3], params[0], params[1], params[3], params[5]]  # in any order, repeated, some without an entry
    got = host_checks.state_entries(opt.state, asked)
    assert len(got) == len(asked)
    assert got[0] is entries[params[3]] and got[3] is entries[params[3]] and got[2] is entries[params[1]]
    assert got[1] is None and got[4] is None
    assert host_checks.state_entries(opt.state, []) == []
    assert host_checks.state_entries({}, asked) == [None] * len(asked)


def test_entries_hold_exactly_when_every_entry_holds_every_given_tensor(host_checks_in):
    a, b = [torch.zeros(2) for _ in range(3)], [torch.zeros(2) for _ in range(3)]
    entries = [{"a": x, "b": y, "other": 0} for x, y in zip(a, b)]
    assert host_checks.entries_hold(entries, {"a": a, "b": b})
    assert host_checks.entries_hold(entries, {})
    assert host_checks.entries_hold([], {"a": []})
    assert not host_checks.entries_hold(entries, {"a": a, "b": a})
    assert not host_checks.entries_hold(entries, {"c": a})  # a key no entry has
    assert not host_checks.entries_hold(entries, {"a": [a[0], a[1], a[2].clone()]})
    for missing in (None, 3.0):
        assert not host_checks.entries_hold([entries[0], missing, entries[2]], {})  # every entry must be a dict
    del entries[1]["b"]
    assert host_checks.entries_hold(entries, {"a": a}) and not host_checks.entries_hold(entries, {"a": a, "b": b})


def test_arguments_of_the_wrong_kind_or_length_are_refused_alike(host_checks_in):
    params, addresses, grads = _params(3)
    with pytest.raises(ValueError, match=r"grads has 2 items where the parameters are 3"):
        host_checks.owns_every_tensor(params, addresses, grads[:2])
    with pytest.raises(TypeError, match=r"addresses must be a list"):
        host_checks.owns_every_tensor(params, tuple(addresses), grads)
    with pytest.raises(TypeError, match=r"state must be a dict"):
        host_checks.state_entries([(params[0], {})], params)
    with pytest.raises(ValueError, match=r"views\['a'\] has 1 items where the parameters are 2"):
        host_checks.entries_hold([{}, {}], {"a": [torch.zeros(1)]})
    with pytest.raises(TypeError, match=r"views must be a dict"):
        host_checks.entries_hold([{}], [("a", [torch.zeros(1)])])


def test_an_unknown_implementation_is_refused_by_name():
    with pytest.raises(ValueError, match=r"no implementation of the host's checks is named 'rust'"):
        host_checks.implementation("rust")


@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_a_run_that_replaces_tensors_and_state_gives_the_same_bits_with_either_implementation(base):
    """The same steps, with a parameter's ``.data``, a gradient and the optimizer state replaced between them, under
    each implementation: the checks see the same changes, so the runs agree bit for bit."""
    cls, kw = (torch.optim.SGD, SGD_KW) if base == "sgd" else (torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2))
    names = host_checks.available()
    if len(names) < 2:
        pytest.skip("the C++ extension is not built: one implementation only")
    results = {}
    for name in names:
        with host_checks.using(name):
            assert host_checks.in_use() == name
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
            results[name] = flat(model)
    first, *others = results.values()
    assert all(torch.equal(first, other) for other in others)
