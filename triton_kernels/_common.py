"""Launcher-side checks: a kernel given the wrong buffer fails here with a message, not with garbage."""

from __future__ import annotations

import torch


def check_flat(name: str, t: torch.Tensor, tile: int | None = None, dtype: torch.dtype | None = None,
               device: torch.device | None = None) -> None:  # fmt: skip
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the buffers on {device}")
    if not t.is_contiguous() or t.dim() != 1:
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}, strides {t.stride()}")
    if tile is not None and t.numel() % tile:
        raise ValueError(f"{name} has {t.numel()} elements, not a multiple of the tile ({tile})")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def check_same(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """A buffer read or written beside ``like``: flat itself (a strided view of the right length would be read as if
    it were contiguous), then of ``like``'s shape, dtype and device."""
    check_flat(name, t)
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(
            f"{name} ({t.dtype} {tuple(t.shape)} on {t.device}) must match {like_name} "
            f"({like.dtype} {tuple(like.shape)} on {like.device})"
        )


def compute_type(dtype: torch.dtype):
    """Triton type of the arithmetic for elements of ``dtype``: float64 stays float64, the rest run in float32."""
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32
