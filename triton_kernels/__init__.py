"""Triton kernels of the fused engine, installed as ``gearsam_fused.triton_kernels``.

One file per kernel family, each holding the ``@triton.jit`` kernels and the launcher that checks its tensors and
picks the grid. All of them work on the flat buffers of :mod:`gearsam_fused.flat`: a bucket is a whole number of
``tile``-element tiles, each tile belongs to one block, ``tile_block[t]`` names it and ``block_tiles[b]:block_tiles[b+1]``
is block ``b``'s tile range.

================  ==========================================================  =====================
launcher          computes                                                    launches
================  ==========================================================  =====================
block_energy      e_b = sum_{i in b} (T_i g_i)^2, deterministic               2 (tiles, then blocks)
allocate          EMA update, radii and per-block scales (GEAR or SAM rule)   1 (one program)
perturb\\_         backup = w;  w += scale[block] * T^2 g                      1
restore\\_         w = backup, bit for bit                                     1
sgd_step\\_        w = backup, then torch's SGD step on w and its momentum     1
adam_step\\_       w = backup, then torch's Adam(W) step on w and its moments  1
================  ==========================================================  =====================

Kernels that do arithmetic are launched with ``enable_fp_fusion=False``: no multiply-add is contracted into an FMA,
so ``w + scale * g`` rounds exactly like the unfused formula of the reference backend, on every Triton version.

Kernels that read ASAM's ``eta`` receive it twice, as ``eta32`` (a ``tl.float32`` argument) and ``eta64`` (a
``tl.float64`` one), and use the one of their compute precision, chosen at compile time. The reference adds ``eta``
to ``|w|`` in the compute precision, so a float32 kernel must add ``eta`` rounded to float32 (a float64 ``eta`` would
promote the sum to float64 and round differently) and a float64 kernel must add it unrounded; a Triton scalar
argument has one type per compiled signature, so one argument cannot serve both.

Importing this package imports triton: set ``TRITON_INTERPRET=1`` before that to run the kernels on CPU tensors
through Triton's interpreter.
"""

from .allocation import allocate
from .base_step import adam_step_, sgd_step_
from .energy import block_energy
from .perturb import perturb_, restore_

__all__ = ["adam_step_", "allocate", "block_energy", "perturb_", "restore_", "sgd_step_"]
