"""Triton kernels of the fused engine, installed as ``gearsam_fused.triton_kernels``.

One file per kernel family, each holding the ``@triton.jit`` kernels and the launcher that checks its tensors and
picks the grid. All of them work on the flat buffers of :mod:`gearsam_fused.flat`: a bucket is a whole number of
``tile``-element tiles, each tile belongs to one block, ``block_of_tile[t]`` names it and
``first_tile_of_block[b]:first_tile_of_block[b+1]`` is block ``b``'s tile range (``friendly_ascent_`` alone takes any
contiguous range of a bucket).

The launchers are the kernel contract's operators, with its names and arguments: what each computes is stated once,
in ``csrc/README.md``'s table, and the signatures in ``csrc/library.cpp``. What is Triton's own is how many kernels
each launches:

======================  =========================================================================
launcher                launches
======================  =========================================================================
block_energy            2 (tiles, then blocks)
allocate                1 (one program)
perturb\\_               1
restore\\_               1
restore_discarding_backup\\_     1
mix_gradient\\_          1
exchange_sharpness\\_    1
friendly_ascent\\_       1
friendly_energy\\_       2 (tiles, then blocks)
sgd_step\\_              1; 2 with the momentum's energies (tiles, then blocks)
adam_step\\_             1; 2 with the momentum's energies
======================  =========================================================================

Kernels that do arithmetic are launched with ``enable_fp_fusion=False``: no multiply-add is contracted into an FMA,
so ``w + scale * g`` rounds exactly like the unfused formula of the reference backend, on every Triton version.

Each launcher is a ``torch.library.triton_op`` of the same name in the ``gearsam_fused_triton`` namespace
(``torch.ops.gearsam_fused_triton.perturb_``), called as the function it replaces, so that torch.compile, fake tensors
and functionalisation see it as one operator, with the arguments it writes declared as ``csrc/library.cpp``'s schema
of the same operator declares them (``tests/kernels/test_triton_ops.py`` holds the two to the same arguments).

Its kernels are launched through ``torch.library.wrap_triton``. Functionalisation keeps each op whole
(``_common.kept_whole``) instead of tracing into its kernels, because of the launch option above: eagerly, and in
make_fx or aot_eager graphs, ``enable_fp_fusion=False`` reaches Triton's launch (wrap_triton passes launch keywords
on), but Inductor compiles a traced user kernel itself with its own options, takes nothing of the launch's, and
leaves Triton's default FMA contraction on. Kept whole, a compiled graph calls the op, and the op launches its
kernels as eager code does. A tensor argument of an op cannot be keyword-only, so the base steps take
``correction``, ``correction_scale``, ``block_of_tile``, ``scalars``, ``found_inf``, ``grad_scale`` and the momentum
energy's ``first_tile_of_block``, ``partials`` and ``momentum_energy`` positionally or by keyword, before the scalars (``allocate`` its ``scalars`` and ``found_inf`` likewise): ``scalars`` holds values the kernels read on
the device (lr and the step count, or rho) and ``found_inf`` GradScaler's overflow flag, which skips the step on the
device, so that a step runs without a host synchronisation and can be captured in a CUDA graph.

Kernels that read ASAM's ``eta`` receive it twice, as ``eta32`` (a ``tl.float32`` argument) and ``eta64`` (a
``tl.float64`` one), and use the one of their compute precision, chosen at compile time. The reference adds ``eta``
to ``|w|`` in the compute precision, so a float32 kernel must add ``eta`` rounded to float32 (a float64 ``eta`` would
promote the sum to float64 and round differently) and a float64 kernel must add it unrounded; a Triton scalar
argument has one type per compiled signature, so one argument cannot serve both. (The energy of a tile whose float32
sum overflowed is taken again in float64, with ``eta64``: :mod:`triton_kernels.energy`.)

Importing this package imports triton: set ``TRITON_INTERPRET=1`` before that to run the kernels on CPU tensors
through Triton's interpreter.
"""

from .allocation import allocate
from .base_step import adam_step_, sgd_step_
from .energy import block_energy, friendly_energy_
from .mix import exchange_sharpness_, friendly_ascent_, mix_gradient_
from .perturb import perturb_, restore_, restore_discarding_backup_

__all__ = [
    "adam_step_",
    "allocate",
    "block_energy",
    "exchange_sharpness_",
    "friendly_ascent_",
    "friendly_energy_",
    "mix_gradient_",
    "perturb_",
    "restore_",
    "restore_discarding_backup_",
    "sgd_step_",
]
