"""The SAM step under ``torch.compile``: ``first_step`` and ``second_step`` compiled with ``fullgraph=True`` on every
fused backend and the same weights, state and allocation as eager; a compiled step that compiles once; the checks a
trace cannot make (replaced gradients and parameters, state changed behind the optimizer's back) made when the
compiled code runs, those of the fused base step's plan too (a parameter without a gradient, state replaced by hand:
refused with the weights put back); a whole training step compiled with graph breaks where torch's own optimizers
have them.

Tolerances: the ``cpp`` and ``triton`` kernels are registered operations that the compiler calls as they are, so
compiled and eager agree bit for bit. The ``torch`` backend's operations are fused by Inductor into kernels of its
own, which round differently (it turns ``rho / (norm + delta)`` into a multiplication by the reciprocal, for one):
there the compiled step agrees within ``FP32_STEP_RTOL`` per step (measured: up to 1.5e-7).
"""

import copy
import math
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.backends.cpp_backend import cpp_installed
from gearsam_fused.schedules import Every

from conftest import FP32_STEP_RTOL, FUSED, loss_fn, mlp, mlp_data, mse, rel_err, stream_threshold_elements, tiny_resnet

BASES = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}
RULES = {"sam": (SAM, {}), "gear-sam": (GEARSAM, dict(partition="fine"))}
CPU_BACKENDS = [case for case in FUSED if case.values[1] == "cpu"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from nothing: a graph cached by another test's optimizer would hide a recompile."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def build(rule: str, base: str, backend: str, device: str = "cpu", **kwargs):
    model = mlp().to(device)
    cls, rule_kwargs = RULES[rule]
    base_cls, base_kwargs = BASES[base]
    opt = cls(model, base_cls, backend=backend, **rule_kwargs, **base_kwargs, **kwargs)
    return model, opt


def run(model, opt, batches, first, second):
    for xy in batches:
        mse(model, xy).backward()
        first(zero_grad=True)
        mse(model, xy).backward()
        second(zero_grad=True)


def compiled_steps(opt, fullgraph: bool = True):
    return torch.compile(opt.first_step, fullgraph=fullgraph), torch.compile(opt.second_step, fullgraph=fullgraph)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def assert_close(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str):
    if exact or not a.any():
        assert torch.equal(a, b), f"{what}: compiled differs from eager by {rel_err(a, b):.3g} (relative)"
    else:
        assert rel_err(a, b) <= FP32_STEP_RTOL, f"{what}: {rel_err(a, b):.3g} relative"


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("backend, device", CPU_BACKENDS)
def test_compiled_step_matches_eager(backend, device, rule, base):
    batches = mlp_data(4)
    eager_model, eager = build(rule, base, backend)
    model, opt = build(rule, base, backend)
    first, second = compiled_steps(opt)
    run(eager_model, eager, batches, eager.first_step, eager.second_step)
    run(model, opt, batches, first, second)
    assert opt.base_step_mode == "fused", opt.base_step_reason
    exact = backend != "torch"
    for i, (a, b) in enumerate(zip(eager_model.parameters(), model.parameters())):
        assert_close(a, b, exact, f"parameter {i}")
        for key, value in eager.state[a].items():
            assert_close(value, opt.state[b][key], exact, f"state[{i}][{key!r}]")
    for name in ("ema", "energy", "radius"):
        assert_close(getattr(eager.step_statistics, name), getattr(opt.step_statistics, name), exact, name)


@pytest.mark.skipif(not cpp_installed(), reason="the C++ extension is not built")
@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_a_bucket_whose_memory_the_kernels_exchange_compiles_to_the_eager_step(base):
    """Past the stream threshold the ``cpp`` CPU kernels exchange the memory of the parameter and backup buffers
    (csrc/cpu/exchange.h): between ``first_step`` and ``second_step`` the parameters live in the backup's first memory,
    holding ``w + eps``, and between steps where they started. Compiled and eager steps agree bit for bit, and with the
    ``torch`` backend, which copies, within ``FP32_STEP_RTOL`` a step (the same gradients given to each, so that no
    difference grows through a model); a step cancelled in between (SAM's restore, ``restore_discarding_backup_``, exchanges
    the memory back too) leaves every parameter where it was."""
    # a square linear layer whose weight alone is past the threshold
    features = math.isqrt(stream_threshold_elements(torch.float32)) + 64
    base_cls, base_kwargs = BASES[base]
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(features, features), torch.nn.Linear(features, 2))]
    models += [copy.deepcopy(models[0]) for _ in range(2)]
    opts = [SAM(m, base_cls, backend=b, **base_kwargs) for m, b in zip(models, ("cpp", "cpp", "torch"))]
    steps = [(opts[0].first_step, opts[0].second_step), compiled_steps(opts[1])]
    steps.append((opts[2].first_step, opts[2].second_step))
    start = [m[0].weight.data_ptr() for m in models]

    def give(model, seed):
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)

    for i in range(4):
        for model, opt, (first, _) in zip(models, opts, steps):
            give(model, 2 * i)
            if i == 1 and opt is not opts[1]:  # cancelled, then taken again
                opt.first_step(cancellable=True)
                opt.cancel_step()
            first(zero_grad=True)
            give(model, 2 * i + 1)
        perturbed = [m[0].weight.detach().clone() for m in models]
        assert torch.equal(perturbed[0], perturbed[1])
        assert rel_err(perturbed[0], perturbed[2]) <= FP32_STEP_RTOL * (i + 1), "the parameters do not hold w + eps"
        for _, second in steps:
            second(zero_grad=True)
    assert [m[0].weight.data_ptr() for m in models] == start, "a step left a parameter in the backup's memory"
    give(models[1], 0)
    opts[1].first_step(cancellable=True)
    assert models[1][0].weight.data_ptr() != start[1], "the perturbation exchanged no memory: nothing was tested"
    opts[1].cancel_step()
    assert models[1][0].weight.data_ptr() == start[1], "cancel_step left the parameter in the backup's memory"
    for a, b, c in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b), (
            f"compiled and eager (its step cancelled and taken again) differ by {rel_err(a, b):.3g}"
        )
        assert rel_err(a, c) <= FP32_STEP_RTOL * 4, f"{rel_err(a, c):.3g} from the torch backend"


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("backend, device", FUSED)
def test_the_compiled_step_stops_recompiling(backend, device, base):
    """The first steps compile a few graphs (SGD's first momentum step; Adam's counts 0, 1, then a symbolic count:
    the kernels take the count, not the floats derived from it, which the compiler would specialise on); after them,
    none. On CUDA too: on an H100 (torch 2.11) a compiled AdamW step's first_step and second_step, which share one
    dynamo cache, reached its limit of 8 graphs."""
    batches = [(x.to(device), y.to(device)) for x, y in mlp_data(6)]
    model, opt = build("gear-sam", base, backend, device)
    first, second = compiled_steps(opt)
    run(model, opt, batches[:3], first, second)
    settled = graphs()
    run(model, opt, batches[3:], first, second)
    assert graphs() == settled, f"the compiled step recompiled after step 3: {graphs()} graphs, was {settled}"


@pytest.mark.parametrize("base_cls", [torch.optim.RMSprop, torch.optim.SGD])
def test_per_tensor_base_step_compiles_with_the_graph_breaks_of_torchs_own_step(base_cls):
    """torch's ``Optimizer.step`` breaks the graph around itself (it must, to run in no_grad), so a second_step that
    calls it compiles with ``fullgraph=False``, as torch's own ``step`` does; the first_step still compiles whole."""
    batches = mlp_data(4)
    eager_model, model = mlp(), mlp()
    eager = SAM(eager_model, base_cls, lr=0.01, base_step="per-tensor")
    opt = SAM(model, base_cls, lr=0.01, base_step="per-tensor")
    run(eager_model, eager, batches, eager.first_step, eager.second_step)
    run(model, opt, batches, torch.compile(opt.first_step, fullgraph=True), torch.compile(opt.second_step))
    assert opt.base_step_mode == "per-tensor"
    for a, b in zip(eager_model.parameters(), model.parameters()):
        assert rel_err(a, b) <= FP32_STEP_RTOL


@pytest.mark.heavy  # a build: a model's forward and backward compiled with the step
@pytest.mark.parametrize("rule", list(RULES))
def test_a_whole_training_step_compiles_and_matches_eager(rule):
    """forward, backward, first_step, forward, backward, second_step under one ``torch.compile`` (graph breaks
    allowed, as in any compiled training step with a backward)."""
    batches = mlp_data(3)
    cls, kwargs = RULES[rule]
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = tiny_resnet()
        opt = cls(model, torch.optim.SGD, lr=0.05, momentum=0.9, backend="cpp" if rule == "sam" else "torch",
                  **({} if rule == "sam" else dict(partition="coarse")))  # fmt: skip
        gen = torch.Generator().manual_seed(3)
        images = [(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in batches]

        def train_step(xy):
            loss_fn(model, xy).backward()
            opt.first_step(zero_grad=True)
            loss = loss_fn(model, xy)
            loss.backward()
            opt.second_step(zero_grad=True)
            return loss.detach()

        step = torch.compile(train_step) if compiled else train_step
        losses = torch.stack([step(xy) for xy in images])
        results.append((losses, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (eager_losses, eager_weights), (losses, weights) = results
    assert rel_err(eager_losses, losses) <= 1e-5
    assert rel_err(eager_weights, weights) <= 1e-5


def test_gradients_replaced_between_compiled_steps_are_read_where_they_are():
    """zero_grad(set_to_none=False) keeps the gradients as views of the flat buffer; set_to_none=True makes backward
    allocate new ones. The compiled step must read both ways, switching between them."""
    batches = mlp_data(4)
    eager_model, eager = build("gear-sam", "sgd", "torch")
    model, opt = build("gear-sam", "sgd", "torch")
    first, second = compiled_steps(opt)
    for i, xy in enumerate(batches):
        for m, o, f, s in ((eager_model, eager, eager.first_step, eager.second_step), (model, opt, first, second)):
            mse(m, xy).backward()
            f()
            o.zero_grad(set_to_none=i % 2 == 0)
            mse(m, xy).backward()
            s()
            o.zero_grad(set_to_none=i % 2 == 1)
    for a, b in zip(eager_model.parameters(), model.parameters()):
        assert rel_err(a, b) <= FP32_STEP_RTOL


def test_a_replaced_parameter_is_refused_by_the_compiled_step():
    model, opt = build("sam", "sgd", "torch")
    first, second = compiled_steps(opt)
    run(model, opt, mlp_data(1), first, second)
    weight = model[0].weight
    weight.data = weight.detach().clone()
    mse(model, mlp_data(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' was replaced .* run one step without torch.compile"):
        first()
    opt.first_step()  # eagerly, the parameter is put back in place
    assert weight.data_ptr() == opt.backend.layout.buckets[0].param.data_ptr()


def test_adam_step_counts_changed_in_place_are_refused_by_the_compiled_step():
    model, opt = build("sam", "adamw", "torch")
    first, second = compiled_steps(opt)
    run(model, opt, mlp_data(2), first, second)
    opt.state[model[0].weight]["step"].fill_(10)
    mse(model, mlp_data(1)[0]).backward()
    with pytest.raises(RuntimeError, match="step counts .* were changed in place"):
        first()


def test_state_a_compiled_step_would_have_to_create_is_refused():
    model = mlp()
    opt = SAM(model, torch.optim.SGD, lr=0.1, backend="torch")  # momentum 0: no buffer is reserved
    first, second = compiled_steps(opt)
    run(model, opt, mlp_data(1), first, second)
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(RuntimeError, match="^optimizer state 'momentum_buffer' does not exist yet"):
        run(model, opt, mlp_data(1), first, second)


def assert_refused_with_w_put_back(model, xy, first, second, spoil, match: str):
    """A step on ``xy`` up to its second backward, then ``spoil()``: ``second`` refuses it with an error matching
    ``match`` and leaves the weights of before the step (``w``, not ``w + eps``)."""
    before = [p.detach().clone() for p in model.parameters()]
    mse(model, xy).backward()
    first(zero_grad=True)
    mse(model, xy).backward()
    spoil()
    with pytest.raises(RuntimeError, match=match):
        second(zero_grad=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_state_replaced_by_hand_is_refused_by_the_compiled_step_then_taken_in_at_its_next_call(state_debug_mode):
    """A compiled second_step plans its buckets without checking each parameter's state (dynamo then guards on none
    of them) and checks them when it runs: in the state debug mode, a state tensor replaced other than by
    load_state_dict is refused with the weights put back, and the next call compiles again and copies it in, as an
    eager step does."""
    batches = mlp_data(4)
    runs = []
    for compiled in (False, True):
        model, opt = build("sam", "sgd", "cpp")
        first, second = compiled_steps(opt) if compiled else (opt.first_step, opt.second_step)
        run(model, opt, batches[:2], first, second)

        def replace(opt=opt, weight=model[0].weight):
            opt.state[weight]["momentum_buffer"] = torch.full_like(weight, 0.5)

        if compiled:
            match = (
                "optimizer state of parameter '0.weight' is not the one the last step left: the weights were restored"
            )
            assert_refused_with_w_put_back(model, batches[2], first, second, replace, match)
            opt.zero_grad()
        else:
            replace()
        run(model, opt, batches[2:], first, second)
        runs.append((model, opt))
    (eager_model, eager), (model, opt) = runs
    for a, b in zip(eager_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(eager.state[a]["momentum_buffer"], opt.state[b]["momentum_buffer"])


@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_a_parameter_without_a_gradient_is_refused_by_the_compiled_step(base):
    """torch's optimizer skips a parameter without a gradient, which the fused update cannot; a second_step compiled
    with every gradient present checks them when it runs, and refuses the step with the weights put back."""
    batches = mlp_data(4)
    model, opt = build("sam", base, "cpp")
    first, second = compiled_steps(opt)
    run(model, opt, batches[:3], first, second)  # Adam's count is symbolic from the third step (see above)

    def drop():
        model[0].bias.grad = None

    match = "parameter '0.bias' has no gradient: torch's optimizer skips it this step: the weights were restored"
    assert_refused_with_w_put_back(model, batches[3], first, second, drop, match)


@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_a_fresh_state_loaded_between_compiled_steps_starts_the_base_optimizer_again(base):
    """load_state_dict makes a compiled step plan its buckets again: here a state with nothing in it, so the next
    step is the base optimizer's first (SGD's momentum taken from the gradient, Adam's count from 1), as eagerly."""
    batches = mlp_data(4)
    runs = []
    for compiled in (False, True):
        model, opt = build("gear-sam", base, "cpp")
        first, second = compiled_steps(opt) if compiled else (opt.first_step, opt.second_step)
        run(model, opt, batches[:2], first, second)
        opt.load_state_dict(build("gear-sam", base, "cpp")[1].state_dict())
        run(model, opt, batches[2:], first, second)
        runs.append((model, opt))
    (eager_model, eager), (model, opt) = runs
    for a, b in zip(eager_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
        for key, value in eager.state[a].items():
            assert torch.equal(value, opt.state[b][key]), key


def test_the_steps_of_a_second_optimizer_compile_in_the_same_process():
    """dynamo makes an integer dynamic once it has compiled the same code for two values of it, here two optimizers'
    keys: nothing the step hands to the compiler as a constant may come from such an integer."""
    for _ in range(2):
        model, opt = build("sam", "sgd", "cpp")
        run(model, opt, mlp_data(3), *compiled_steps(opt))
        assert opt._opt_called and opt.base_optimizer._opt_called


def test_schedules_are_refused_inside_a_compiled_step():
    """Refused with our message as the one the error says first (not dynamo's "Observed exception")."""
    model, opt = build("sam", "sgd", "torch", schedule=Every(2))
    first, _ = compiled_steps(opt)
    mse(model, mlp_data(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"^a schedule decides on the host which steps take the second pass"):
        first()


def test_a_loaded_state_continues_under_the_compiled_step():
    """load_state_dict takes the loaded state (Adam's counts among it) into the flat buffers at once, eagerly, so the
    compiled step that follows reads nothing it cannot trace."""
    batches = mlp_data(4)
    model, opt = build("gear-sam", "adamw", "cpp")
    run(model, opt, batches[:2], opt.first_step, opt.second_step)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(opt.state_dict())  # its tensors are the optimizer's own, as torch's are
    run(model, opt, batches[2:], opt.first_step, opt.second_step)
    resumed_model, resumed = build("gear-sam", "adamw", "cpp")
    resumed_model.load_state_dict(saved_model)
    resumed.load_state_dict(saved)
    run(resumed_model, resumed, batches[2:], *compiled_steps(resumed))
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend, device", CPU_BACKENDS)
def test_the_compiled_step_tells_lr_schedulers_it_stepped_without_setting_attributes_of_optimizers(backend, device):
    """Both optimizers are marked as stepped (``_opt_called``, what torch's LR schedulers read) when the compiled
    step is traced; the compiled code itself sets no attribute of an optimizer, which dynamo could not trace in some
    torch versions: a mark removed between compiled steps stays removed."""
    model, opt = build("sam", "sgd", backend)
    scheduler = torch.optim.lr_scheduler.StepLR(opt.base_optimizer, step_size=1)
    first, second = compiled_steps(opt)
    run(model, opt, mlp_data(1), first, second)
    assert opt._opt_called and opt.base_optimizer._opt_called
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a scheduler step before any optimizer step
        scheduler.step()
    run(model, opt, mlp_data(2)[1:], first, second)  # the graphs of the steps after the first
    compiled = graphs()
    del opt._opt_called, opt.base_optimizer._opt_called
    run(model, opt, mlp_data(3)[2:], first, second)
    assert graphs() == compiled, "the mark's removal recompiled the step"
    assert not hasattr(opt, "_opt_called") and not hasattr(opt.base_optimizer, "_opt_called")


def test_the_host_checks_declare_the_gradient_buffers_written_and_advance_their_versions():
    # declared written: the compiler keeps them in the graph, ordered before what reads or writes the buffers
    for name in ("sync_", "check_ready_", "check_second_gradient_"):
        grads = getattr(torch.ops.gearsam_fused, name).default._schema.arguments[0]
        assert grads.name == "grads" and grads.alias_info is not None and grads.alias_info.is_write, name
    model = torch.nn.Linear(8, 8)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = SAM(model, torch.optim.SGD, backend="torch", lr=0.1, momentum=0.9)
    opt.first_step()
    opt.second_step()
    layout = opt.backend.layout
    grads = [bucket.grad for bucket in layout.buckets]
    before = grads[0]._version
    torch.ops.gearsam_fused.sync_(grads, [], layout.key)  # nothing to copy in: the version still advances, once
    assert grads[0]._version == before + 1
    model.weight.grad = torch.full_like(model.weight, 2.0)  # a gradient of its own: the sync copies it in
    torch.ops.gearsam_fused.sync_(grads, [], layout.key)
    assert grads[0]._version > before + 1
    assert model.weight.grad.data_ptr() >= grads[0].data_ptr() and torch.all(model.weight.grad == 2.0)
    with pytest.raises(RuntimeError, match="copies of the flat gradient buffers"):
        torch.ops.gearsam_fused.sync_([g.clone() for g in grads], [], layout.key)
