"""Triton kernels of the fused engine, installed as ``gearsam_fused.triton_kernels``.

The fused flat-buffer kernels (block energy, allocation, perturb, restore) live here, one file per kernel family
with its launcher and wrapper beside it. This version ships none yet: ``backend="triton"`` reports itself as
unavailable, and nothing in this package imports triton.
"""
