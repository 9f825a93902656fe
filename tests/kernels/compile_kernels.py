"""Compile every Triton kernel variant of ``gearsam_fused.triton_kernels`` for a CUDA architecture, without a GPU.

    python tests/kernels/compile_kernels.py [capability]      # default 90 (Hopper)

Prints one JSON object: for each variant, the length of its PTX and how many atomic instructions it contains.
Run it in a process where TRITON_INTERPRET is unset (under the interpreter, kernels are not compilable objects).
"""

from __future__ import annotations

import json
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gearsam_fused.flat import TILE
from gearsam_fused.triton_kernels import allocation, base_step, energy, mix, perturb

FLOATS = {"fp32": tl.float32, "bf16": tl.float32, "fp16": tl.float32, "fp64": tl.float64}  # storage -> compute


def variants():
    """(name, kernel, signature of runtime arguments, constexprs)."""
    for storage, compute in FLOATS.items():
        for adaptive, product in ((False, False), (True, False), (False, True)):
            yield (
                f"tile_energy[{storage},adaptive={adaptive},product={product}]",
                energy._tile_energy_kernel,
                {
                    "grad_ptr": f"*{storage}",
                    "second_ptr": f"*{storage}",
                    "partial_ptr": "*fp64",
                    "n_tiles": "i64",
                    "eta32": "fp32",
                    "eta64": "fp64",
                },
                {"ADAPTIVE": adaptive, "PRODUCT": product, "TILE": TILE, "ACC": compute},
            )
        for adaptive in (False, True):
            for keep in (False, True):
                yield (
                    f"perturb[{storage},adaptive={adaptive},keep={keep}]",
                    perturb._perturb_kernel,
                    {"param_ptr": f"*{storage}", "grad_ptr": f"*{storage}", "backup_ptr": f"*{storage}",
                     "kept_ptr": f"*{storage}", "scale_ptr": "*fp64", "block_of_tile_ptr": "*i32", "eta32": "fp32",
                     "eta64": "fp64"},
                    {"ADAPTIVE": adaptive, "KEEP": keep, "TILE": TILE, "COMPUTE": compute},
                )  # fmt: skip
        yield (
            f"restore[{storage}]",
            perturb._restore_kernel,
            {"param_ptr": f"*{storage}", "backup_ptr": f"*{storage}"},
            {"TILE": TILE},
        )
        yield (
            f"mix_gradient[{storage}]",
            mix._mix_kernel,
            {"grad_ptr": f"*{storage}", "correction_ptr": f"*{storage}", "grad_scale_ptr": "*fp64",
             "correction_scale_ptr": "*fp64", "block_of_tile_ptr": "*i32"},
            {"TILE": TILE, "COMPUTE": compute},
        )  # fmt: skip
        yield (
            f"exchange_sharpness[{storage}]",
            mix._exchange_kernel,
            {"grad_ptr": f"*{storage}", "correction_ptr": f"*{storage}"},
            {"TILE": TILE, "COMPUTE": compute},
        )
        for first, small in ((True, True), (False, True), (False, False)):
            yield (
                f"friendly_ascent[{storage},first={first},small={small}]",
                mix._friendly_kernel,
                {"grad_ptr": f"*{storage}", "momentum_ptr": f"*{storage}", "n": "i64", "sigma32": "fp32",
                 "sigma64": "fp64", "weight32": "fp32", "weight64": "fp64"},
                {"FIRST": first, "SMALL": small, "BLOCK": mix.FRIENDLY_BLOCK, "COMPUTE": compute},
            )  # fmt: skip
            for adaptive in (False, True):
                yield (
                    f"friendly_energy[{storage},first={first},small={small},adaptive={adaptive}]",
                    energy._friendly_energy_kernel,
                    {"grad_ptr": f"*{storage}", "momentum_ptr": f"*{storage}", "param_ptr": f"*{storage}",
                     "partial_ptr": "*fp64", "sigma32": "fp32", "sigma64": "fp64", "weight32": "fp32",
                     "weight64": "fp64", "eta32": "fp32", "eta64": "fp64"},
                    {"FIRST": first, "SMALL": small, "ADAPTIVE": adaptive, "TILE": TILE, "ACC": compute},
                )  # fmt: skip
    yield (
        "block_sum",
        energy._block_sum_kernel,
        {
            "partial_ptr": "*fp64",
            "first_tile_of_block_ptr": "*i64",
            "energy_ptr": "*fp64",
            "n_tiles": "i64",
            "n_blocks": "i64",
        },
        {"CHUNK": energy._BLOCK_CHUNK},
    )
    yield from base_step_variants()
    for gear in (True, False):
        yield (
            f"allocate[gear={gear}]",
            allocation._allocate_kernel,
            {"energy_ptr": "*fp64", "ema_ptr": "*fp64", "scale_ptr": "*fp64", "radius_ptr": "*fp64", "n_blocks": "i32",
             "rho": "fp64", "beta": "fp64", "delta": "fp64"},
            {"GEAR": gear, "CHUNK": allocation._CHUNK},
        )  # fmt: skip


def base_step_variants():
    """The fused base steps per storage dtype, with every optional branch compiled in (the momentum's energies
    included)."""

    def arguments(pointers, scalars, storage):
        pairs = {f"{n}{bits}": f"fp{bits}" for n in scalars for bits in ("32", "64")}
        return {**{f"{n}_ptr": f"*{storage}" for n in pointers}, **pairs}

    for storage in ("fp32", "fp64"):
        yield (
            f"sgd_step[{storage}]",
            base_step._sgd_kernel,
            {**arguments(("param", "grad", "backup", "buf"), ("neg_lr", "weight_decay", "momentum",
                                                               "one_minus_dampening"), storage),
             "partial_ptr": "*fp64"},
            {"HAS_WEIGHT_DECAY": True, "HAS_MOMENTUM": True, "NESTEROV": True, "MAXIMIZE": True, "FIRST": False,
             "TILE": TILE, "COMPUTE": FLOATS[storage], "ENERGY": True},
        )  # fmt: skip
        yield (
            f"adam_step[{storage}]",
            base_step._adam_kernel,
            {**arguments(("param", "grad", "backup", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
                         ("lerp_weight", "beta2_", "one_minus_beta2_", "eps", "weight_decay", "decay", "neg_step_size",
                          "bias_correction2_sqrt"), storage),
             "partial_ptr": "*fp64"},
            {"HAS_WEIGHT_DECAY": True, "DECOUPLED": True, "AMSGRAD": True, "MAXIMIZE": True, "LERP_SMALL": True,
             "TILE": TILE, "COMPUTE": FLOATS[storage], "ENERGY": True},
        )  # fmt: skip


def compile_all(capability: int) -> dict:
    target = GPUTarget("cuda", capability, 32)
    report = {}
    for name, kernel, signature, constexprs in variants():
        source = ASTSource(
            fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs
        )
        ptx = triton.compile(source, target=target, options={"enable_fp_fusion": False}).asm["ptx"]
        report[name] = {
            "ptx_lines": ptx.count("\n"),
            "atomics": sum(line.strip().startswith(("atom.", "red.")) for line in ptx.splitlines()),
            # approximate division or square root (what float32 `/` and tl.sqrt compile to on NVIDIA GPUs)
            "approx": sum(".approx" in line or "div.full" in line for line in ptx.splitlines()),
        }
    return report


if __name__ == "__main__":
    print(json.dumps(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
