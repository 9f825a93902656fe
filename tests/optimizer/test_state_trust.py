"""The fused base step checks the optimizer state once and then trusts it (gearsam_fused.base_step): what can change
the state makes the next step check it again, a state tensor replaced by hand is not read (and ``state_dict()``
refuses to save it), and ``set_state_debug_mode(True)`` checks every step and takes replaced state in.

Each run is held to the same backend stepping the base optimizer per tensor (``foreach=False``), whose update reads
the state it finds as torch's own step does: on the CPU SGD's fused step gives its bits."""

import collections

import pytest
import torch

from gearsam_fused import SAM, set_state_debug_mode

from conftest import batches, flat, loss_fn, sam_step, tiny_resnet

SGD_DAMPENED = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=5e-4)  # dampening: the first step shows
BACKENDS = ["torch", "cpp"]


def build(backend: str, base_step: str, buckets: int = 1, **kw):
    """``base_step`` "fused" builds with "auto": a step whose plan declines then steps per tensor. ``buckets``: 2 puts
    the classifier in a param group (and so a flat bucket) of its own."""
    model = tiny_resnet()
    base_step = "auto" if base_step == "fused" else base_step
    params = model.parameters()
    if buckets == 2:
        head = [model.fc.weight, model.fc.bias]
        params = [{"params": [p for p in model.parameters() if all(p is not q for q in head)]}, {"params": head}]
    opt = SAM(params, torch.optim.SGD, model=model, rho=0.05, backend=backend, base_step=base_step, foreach=False, **kw)
    return model, opt


def replace_by_hand(opt, model, value: float = 0.5) -> None:
    opt.state[model.fc.weight]["momentum_buffer"] = torch.full_like(model.fc.weight, value)


def runs(backend: str, between, steps: int = 4, base_steps=("fused", "per-tensor"), kw=SGD_DAMPENED,
         buckets: int = 1) -> dict:  # fmt: skip
    """The weights and optimizer after ``steps`` SAM steps on each base step, ``between(opt, model)`` called before
    step 2."""
    out = {}
    for base_step in base_steps:
        model, opt = build(backend, base_step, buckets, **kw)
        for i, xy in enumerate(batches(steps, seed=11)):
            if i == 2:
                between(opt, model)
            sam_step(opt, model, xy)
        assert opt.base_step_mode == base_step
        out[base_step] = flat(model), opt
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_replaced_by_hand_is_not_read_and_state_dict_refuses_to_save_it(backend):
    """Trusted state: the steps after a replacement by hand go on from the flat buffers, as if nothing had been
    replaced, and ``state_dict()`` names the parameter rather than save a state no step read."""
    replaced = runs(backend, replace_by_hand, base_steps=("fused",))["fused"]
    untouched = runs(backend, lambda opt, model: None, base_steps=("fused",))["fused"]
    assert torch.equal(replaced[0], untouched[0])
    with pytest.raises(RuntimeError, match=r"state of parameter 'fc.weight' was replaced .*set_state_debug_mode"):
        replaced[1].state_dict()
    untouched[1].state_dict()


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_debug_mode_state_replaced_by_hand_is_taken_in_as_torchs_step_reads_it(backend, state_debug_mode):
    done = runs(backend, replace_by_hand)
    assert torch.equal(done["fused"][0], done["per-tensor"][0])
    assert not torch.equal(done["fused"][0], runs(backend, lambda opt, model: None, base_steps=("fused",))["fused"][0])
    done["fused"][1].state_dict()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("buckets", [1, 2])
@pytest.mark.parametrize("change", ["clear", "new-dict", "momentum-on", "one-deleted"])
def test_what_changes_the_state_makes_the_next_step_check_it_again(backend, change, buckets):
    """A cleared state or a new state mapping starts the momentum again, as torch's step does; momentum switched on
    mid-run (from 0) gives every parameter a buffer from the next gradient; a parameter's entry deleted starts its
    buffer again. Each, on the fused step, as per tensor, and in every bucket: the bucket that notices the change
    first does not vouch for the others."""

    def between(opt, model):
        if change == "clear":
            opt.base_optimizer.state.clear()
        elif change == "one-deleted":
            del opt.base_optimizer.state[model.fc.weight]  # in the last bucket
        elif change == "new-dict":
            # as many entries as before, each empty: the state's size alone does not show the change
            opt.base_optimizer.state = collections.defaultdict(dict, {p: {} for p in model.parameters()})
        else:
            for group in opt.param_groups:
                group["momentum"], group["dampening"] = 0.8, 0.2

    kw = {**SGD_DAMPENED, "momentum": 0.0, "dampening": 0.0} if change == "momentum-on" else SGD_DAMPENED
    done = runs(backend, between, kw=kw, buckets=buckets)
    assert torch.equal(done["fused"][0], done["per-tensor"][0])
    unchanged = runs(backend, lambda opt, model: None, base_steps=("fused",), kw=kw, buckets=buckets)["fused"][0]
    assert not torch.equal(done["fused"][0], unchanged)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_of_the_base_optimizers_own_makes_the_next_fused_step_check_the_state_again(backend):
    """State replaced by hand, then a step taken per tensor (a parameter without a gradient: torch's step skips it and
    reads the replaced tensor for the others), then fused steps: they take the replaced tensor in, as torch's step
    goes on from it."""

    def between(opt, model):
        replace_by_hand(opt, model)
        loss_fn(model, batches(1, seed=5)[0]).backward()
        model.fc.bias.grad = None
        assert opt.first_step(zero_grad=True)
        loss_fn(model, batches(1, seed=5)[0]).backward()
        model.fc.bias.grad = None
        opt.second_step(zero_grad=True)
        assert opt.base_step_mode == "per-tensor"

    done = runs(backend, between, base_steps=("fused",))
    model, opt = build(backend, "per-tensor", **SGD_DAMPENED)
    for i, xy in enumerate(batches(4, seed=11)):
        if i == 2:
            between(opt, model)
        sam_step(opt, model, xy)
    assert torch.equal(done["fused"][0], flat(model))
    done["fused"][1].state_dict()


def test_the_debug_mode_takes_only_a_boolean():
    with pytest.raises(TypeError, match=r"set_state_debug_mode takes True or False, got 1"):
        set_state_debug_mode(1)
