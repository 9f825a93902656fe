"""The Triton launchers as registered ops (``torch.ops.gearsam_fused_triton.*``): ``torch.library.opcheck`` on each
op over its configurations, the same bits as a direct launch of its kernels, and a ``torch.compile(fullgraph=True)``
step that gives the bits of the eager one.

On CPU the kernels run through Triton's interpreter, so buffers are small: tiles of 16 elements, 5 tiles in 3 blocks.
opcheck runs every one of its checks here (schema, autograd registration, fake tensors, AOT dispatch with static and
dynamic shapes): none is inapplicable under the interpreter. opcheck compares a compiled call's outputs, not what it
mutates, so a second test compiles each op and compares every buffer it writes with an eager call's. The base steps'
bits against torch.optim are asserted by tests/test_base_step.py and tests/test_correction_kernels.py, which call
these same ops."""

import pytest
import torch

from conftest import on_device

#: Each case once on the CPU (interpreter) and once on a GPU.
DEVICES = [on_device("triton", d) for d in ("cpu", "cuda")]
TILE = 16
TILE_BLOCK = [0, 0, 1, 2, 2]  # 5 tiles in 3 blocks
BLOCK_TILES = [0, 2, 3, 5]
N = TILE * len(TILE_BLOCK)
SCALE = [0.25, 0.0, -1.5e-2]  # block 1 skipped this step: its weights keep their bits
STORED = [torch.float32, torch.float64, torch.bfloat16, torch.float16]  # energy, perturb and restore
STEPPED = [torch.float32, torch.float64]  # the base steps

SGD = {
    "plain": dict(lr=0.1),
    "momentum-first": dict(lr=0.05, momentum=0.9, first=True),
    "momentum": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    "nesterov-maximize": dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True),
}
ADAM = {
    "adam": dict(),
    "adam-l2": dict(weight_decay=1e-2),
    "adamw": dict(weight_decay=1e-2, decoupled=True),
    "amsgrad": dict(amsgrad=True, maximize=True),
}


@pytest.fixture(scope="module")
def ops():
    pytest.importorskip("triton")
    from gearsam_fused import triton_kernels  # imports triton: after conftest has chosen the interpreter

    return torch.ops.gearsam_fused_triton, triton_kernels


def randn(dtype, device, seed, n=N):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device, dtype)


def tables(device):
    """(tile_block int32, block_tiles int64, scale float64 [B]) of the 5-tile bucket."""
    return (
        torch.tensor(TILE_BLOCK, dtype=torch.int32, device=device),
        torch.tensor(BLOCK_TILES, dtype=torch.int64, device=device),
        torch.tensor(SCALE, dtype=torch.float64, device=device),
    )


# ------------------------------------------------------------------------------------------- the ops' names
def test_every_launcher_is_its_op(ops):
    namespace, kernels = ops
    mutated = {
        "block_energy": {"partials"},
        "allocate": {"ema"},
        "perturb_": {"param", "backup"},
        "restore_": {"param"},
        "sgd_step_": {"param", "momentum_buffer"},
        "adam_step_": {"param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    }
    assert set(kernels.__all__) == set(mutated)
    for name, args in mutated.items():
        schema = getattr(namespace, name).default._schema
        assert getattr(kernels, name)._opoverload is getattr(namespace, name).default
        assert {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write} == args, name


# ------------------------------------------------------------------------------------------- opcheck
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("dtype", STORED, ids=str)
@pytest.mark.parametrize("backend,device", DEVICES)
def test_opcheck_block_energy(ops, backend, device, dtype, adaptive):
    _, block_tiles, _ = tables(device)
    partials = torch.full((len(TILE_BLOCK),), float("nan"), dtype=torch.float64, device=device)
    args = (randn(dtype, device, 0), randn(dtype, device, 1), block_tiles, partials)
    torch.library.opcheck(ops[0].block_energy.default, args, dict(tile=TILE, adaptive=adaptive, eta=0.01))


@pytest.mark.parametrize("gear", [False, True], ids=["sam", "gear-sam"])
@pytest.mark.parametrize("backend,device", DEVICES)
def test_opcheck_allocate(ops, backend, device, gear):
    energy = randn(torch.float64, device, 0, n=3).square()
    ema = randn(torch.float64, device, 1, n=3).square()
    torch.library.opcheck(ops[0].allocate.default, (energy, ema), dict(gear=gear, rho=0.05, beta=0.9, delta=1e-12))


@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("dtype", STORED, ids=str)
@pytest.mark.parametrize("backend,device", DEVICES)
def test_opcheck_perturb_and_restore(ops, backend, device, dtype, adaptive):
    tile_block, _, scale = tables(device)
    param, grad, backup = randn(dtype, device, 0), randn(dtype, device, 1), torch.zeros(N, dtype=dtype, device=device)
    kwargs = dict(tile=TILE, adaptive=adaptive, eta=0.01)
    torch.library.opcheck(ops[0].perturb_.default, (param, grad, backup, scale, tile_block), kwargs)
    torch.library.opcheck(ops[0].restore_.default, (param, randn(dtype, device, 2)), dict(tile=TILE))


def base_step_args(dtype, device, backup: bool, corrected: bool) -> dict:
    """param, grad, backup (None: the step reads param itself) and LookSAM's correction (or none)."""
    tile_block, _, scale = tables(device)
    correction = dict(correction=randn(dtype, device, 3), correction_scale=scale, tile_block=tile_block)
    return dict(
        param=randn(dtype, device, 0),
        grad=randn(dtype, device, 1),
        backup=randn(dtype, device, 2) if backup else None,
        **(correction if corrected else dict(correction=None, correction_scale=None, tile_block=None)),
    )


def opcheck_step(op, args: dict, scalars: dict) -> None:
    """opcheck with the tensors positional, as the schema orders them, and the scalars as keywords."""
    names = [a.name for a in op._schema.arguments if not a.kwarg_only]
    torch.library.opcheck(op, tuple(args[name] for name in names), scalars)


@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "looksam"])
@pytest.mark.parametrize("backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("flags", list(SGD))
@pytest.mark.parametrize("dtype", STEPPED, ids=str)
@pytest.mark.parametrize("backend,device", DEVICES)
def test_opcheck_sgd_step(ops, backend, device, dtype, flags, backup, corrected):
    scalars = {"tile": TILE, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0, "nesterov": False,
               "maximize": False, "first": False, **SGD[flags]}  # fmt: skip
    args = base_step_args(dtype, device, backup, corrected)
    args["momentum_buffer"] = randn(dtype, device, 4) if scalars["momentum"] else None
    opcheck_step(ops[0].sgd_step_.default, args, scalars)


@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "looksam"])
@pytest.mark.parametrize("backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("flags", list(ADAM))
@pytest.mark.parametrize("dtype", STEPPED, ids=str)
@pytest.mark.parametrize("backend,device", DEVICES)
def test_opcheck_adam_step(ops, backend, device, dtype, flags, backup, corrected):
    kw = {"weight_decay": 0.0, "decoupled": False, "amsgrad": False, "maximize": False, **ADAM[flags]}
    scalars = dict(kw, tile=TILE, beta1=0.9, beta2=0.999, eps=1e-8, lr=1e-2, step=3)
    args = base_step_args(dtype, device, backup, corrected)
    args["exp_avg"] = 0.1 * randn(dtype, device, 4)
    args["exp_avg_sq"] = 0.01 * randn(dtype, device, 5).square()
    args["max_exp_avg_sq"] = 1.5 * args["exp_avg_sq"] if kw["amsgrad"] else None
    opcheck_step(ops[0].adam_step_.default, args, scalars)


# ------------------------------------------------------------------------------------------- bits
def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("dtype", STORED, ids=str)
@pytest.mark.parametrize("backend,device", DEVICES)
def test_ops_give_the_bits_of_a_direct_launch(ops, backend, device, dtype, adaptive):
    """Each op against its kernels launched as the launchers launched them before they were ops."""
    from gearsam_fused.triton_kernels import allocation, energy, perturb
    from gearsam_fused.triton_kernels._common import compute_type

    _, kernels = ops
    tile_block, block_tiles, scale = tables(device)
    w, grad, eta, n_tiles = randn(dtype, device, 0), randn(dtype, device, 1), 0.01, len(TILE_BLOCK)
    consts = dict(ADAPTIVE=adaptive, TILE=TILE, enable_fp_fusion=False)

    param, backup = w.clone(), torch.empty_like(w)
    kernels.perturb_(param, grad, backup, scale, tile_block, tile=TILE, adaptive=adaptive, eta=eta)
    expected, expected_backup = w.clone(), torch.empty_like(w)
    perturb._perturb_kernel[(n_tiles,)](expected, grad, expected_backup, scale, tile_block, eta, eta,
                                        COMPUTE=compute_type(dtype), **consts)  # fmt: skip
    assert bitwise_equal(param, expected) and bitwise_equal(backup, expected_backup) and bitwise_equal(backup, w)
    assert not bitwise_equal(param, w)  # the perturbation moved the weights
    kernels.restore_(param, backup, tile=TILE)
    assert bitwise_equal(param, w)

    partials = torch.empty(n_tiles, dtype=torch.float64, device=device)
    got = kernels.block_energy(grad, w, block_tiles, partials, tile=TILE, adaptive=adaptive, eta=eta)
    partials_expected, energy_expected = torch.empty_like(partials), torch.empty(3, dtype=torch.float64, device=device)
    energy._tile_energy_kernel[(n_tiles,)](grad, w, partials_expected, eta, eta, ACC=compute_type(dtype), **consts)
    energy._block_sum_kernel[(3,)](partials_expected, block_tiles, energy_expected, CHUNK=energy._BLOCK_CHUNK)
    assert bitwise_equal(partials, partials_expected) and bitwise_equal(got, energy_expected)

    for gear in (False, True):
        ema, ema_expected = got.sqrt(), got.sqrt()
        scale_got, radius_got = kernels.allocate(got, ema, gear=gear, rho=0.05, beta=0.9, delta=1e-12)
        scale_expected, radius_expected = torch.empty_like(got), torch.empty_like(got)
        allocation._allocate_kernel[(1,)](got, ema_expected, scale_expected, radius_expected, 3, 0.05, 0.9, 1e-12,
                                          GEAR=gear, CHUNK=allocation._CHUNK, enable_fp_fusion=False)  # fmt: skip
        assert bitwise_equal(ema, ema_expected) and bitwise_equal(scale_got, scale_expected)
        assert bitwise_equal(radius_got, radius_expected)


@pytest.mark.parametrize("dtype", STEPPED, ids=str)
@pytest.mark.parametrize("backend,device", DEVICES)
def test_a_step_without_backup_reads_param_itself(ops, backend, device, dtype):
    """``backup=None`` steps from param's own weights: the bits of a step from a copy of them."""
    _, kernels = ops
    w, grad = randn(dtype, device, 0), randn(dtype, device, 1)
    sgd = dict(tile=TILE, lr=0.1, weight_decay=1e-3, momentum=0.9, dampening=0.0, nesterov=True, maximize=False,
               first=False)  # fmt: skip
    results = []
    for backup in (None, w.clone()):
        param, buffer = w.clone(), randn(dtype, device, 2)
        kernels.sgd_step_(param, grad, backup, buffer, **sgd)
        results.append((param, buffer))
    assert all(bitwise_equal(a, b) for a, b in zip(*results))
    assert not bitwise_equal(results[0][0], w)


# ------------------------------------------------------------------------------------------- torch.compile
def compiled_afresh(fn, backend: str):
    """torch.compile(fn, fullgraph=True) with no cached graph: a cached graph is keyed by the graph and (off the
    interpreter) by the kernels' sources, not by how the ops are registered, and would outlive a change to that."""
    from contextlib import ExitStack

    compiled = torch.compile(fn, fullgraph=True, backend=backend)

    def call(*args):
        with ExitStack() as stack:
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
            return compiled(*args)

    return call


OP_CALLS = ["block_energy", "allocate", "perturb_", "restore_", "sgd_step_", "sgd_step_-no-backup", "adam_step_"]


def op_calls(device):
    """name -> (a call of the op on a tuple of tensors, those tensors): every op once, each writing all it may write."""
    from gearsam_fused import triton_kernels as k

    tile_block, block_tiles, scale = tables(device)
    f32 = [randn(torch.float32, device, seed) for seed in range(6)]
    sgd = dict(tile=TILE, lr=0.05, weight_decay=1e-3, momentum=0.9, dampening=0.0, nesterov=True, maximize=False,
               first=False)  # fmt: skip
    adam = dict(tile=TILE, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, decoupled=True, amsgrad=True,
                maximize=False, lr=0.01, step=2)  # fmt: skip
    moments = [0.1 * f32[3], 0.01 * f32[4].square(), 0.02 * f32[5].square()]
    partials = torch.zeros(5, dtype=torch.float64, device=device)
    energy = f32[0].double()[:3].square()
    return {
        "block_energy": (lambda g, w, p: k.block_energy(g, w, block_tiles, p, tile=TILE, adaptive=True, eta=0.01),
                         (f32[0], f32[1], partials)),
        "allocate": (lambda e, ema: k.allocate(e, ema, gear=True, rho=0.05, beta=0.9, delta=1e-12),
                     (energy, energy.sqrt())),
        "perturb_": (lambda w, g, b: k.perturb_(w, g, b, scale, tile_block, tile=TILE, adaptive=True, eta=0.01),
                     (f32[0], f32[1], f32[2])),
        "restore_": (lambda w, b: k.restore_(w, b, tile=TILE), (f32[0], f32[1])),
        "sgd_step_": (lambda w, g, b, buf, c: k.sgd_step_(w, g, b, buf, c, scale, tile_block, **sgd),
                      (f32[0], f32[1], f32[2], f32[3], f32[4])),
        "sgd_step_-no-backup": (lambda w, g, buf: k.sgd_step_(w, g, None, buf, **sgd), (f32[0], f32[1], f32[3])),
        "adam_step_": (lambda w, g, b, m, v, vmax: k.adam_step_(w, g, b, m, v, vmax, **adam),
                       (f32[0], f32[1], f32[2], *moments)),
    }  # fmt: skip


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", OP_CALLS)
@pytest.mark.parametrize("backend,device", DEVICES)
def test_a_compiled_op_writes_the_bits_of_an_eager_one(ops, backend, device, name, compiler):
    calls = op_calls(device)
    assert list(calls) == OP_CALLS
    call, tensors = calls[name]
    eager, compiled = [t.clone() for t in tensors], [t.clone() for t in tensors]
    expected, got = call(*eager), compiled_afresh(call, compiler)(*compiled)
    assert all(bitwise_equal(a, b) for a, b in zip(compiled, eager))
    assert any(not bitwise_equal(a, b) for a, b in zip(eager, tensors))  # the op wrote something
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, expected))):
        assert (a is None and b is None) or bitwise_equal(a, b)


def energy_at_the_perturbed_point(param, grad, backup, scale, tile_block, block_tiles, partials):
    """SAM's pass over a bucket: perturb, read the perturbed weights (ASAM's energy), restore."""
    from gearsam_fused import triton_kernels as kernels

    kernels.perturb_(param, grad, backup, scale, tile_block, tile=TILE, adaptive=True, eta=0.01)
    energy = kernels.block_energy(grad, param, block_tiles, partials, tile=TILE, adaptive=True, eta=0.01)
    kernels.restore_(param, backup, tile=TILE)
    return energy


def perturbed_copy(param, grad, backup, scale, tile_block, block_tiles, partials):
    """The perturbed weights cloned between perturb_ and restore_."""
    from gearsam_fused import triton_kernels as kernels

    kernels.perturb_(param, grad, backup, scale, tile_block, tile=TILE, adaptive=True, eta=0.01)
    perturbed = param.clone()
    kernels.restore_(param, backup, tile=TILE)
    return perturbed


# Inductor (torch 2.13) returns the restored weights for the clone: its reinplacing reuses the clone's buffer as the
# copy that restore_'s functionalised form writes. Any mutating custom op does it (a two-line torch.library.custom_op
# pair shows it on CPU), aot_eager does not; a value computed from the weights, as the energy is, is not affected.
CLONE_BETWEEN_MUTATIONS = pytest.mark.xfail(reason="Inductor drops a clone taken between two mutating custom ops")
PASSES = [
    pytest.param(energy_at_the_perturbed_point, id="energy"),
    pytest.param(perturbed_copy, marks=CLONE_BETWEEN_MUTATIONS, id="clone"),
]


@pytest.mark.parametrize("fn", PASSES)
@pytest.mark.parametrize("backend,device", DEVICES)
def test_compiled_perturb_and_restore_give_the_eager_bits(ops, backend, device, fn):
    """perturb_, a read, restore_ under ``torch.compile(fullgraph=True)`` (Inductor): no graph break, the eager bits."""
    tile_block, block_tiles, scale = tables(device)
    w, grad = randn(torch.float32, device, 0), randn(torch.float32, device, 1)
    runs = []
    for f in (fn, compiled_afresh(fn, "inductor")):
        param, backup, partials = w.clone(), torch.zeros_like(w), torch.zeros(5, dtype=torch.float64, device=device)
        runs.append((f(param, grad, backup, scale, tile_block, block_tiles, partials), param, backup, partials))
    (eager, _, _, eager_partials), (got, param, backup, partials) = runs
    assert bitwise_equal(got, eager) and bitwise_equal(partials, eager_partials)
    assert bitwise_equal(param, w) and bitwise_equal(backup, w)
    unperturbed = fn(w.clone(), grad, torch.zeros_like(w), torch.zeros_like(scale), tile_block, block_tiles, partials)
    assert not bitwise_equal(got, unperturbed)  # the compiled graph did perturb
