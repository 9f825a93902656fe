"""Backend registry and the one dispatch point that turns a backend name into an implementation."""

from __future__ import annotations

import torch

from .base import Backend
from .reference import ReferenceBackend

#: Backends built into this installation, by name.
BACKENDS: dict[str, type[Backend]] = {"reference": ReferenceBackend}

#: Names the library knows of but that this version does not provide yet.
PLANNED = ("torch", "triton", "cpp")


def available_backends() -> list[str]:
    return list(BACKENDS)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """Turn ``"auto"`` into a concrete backend for ``device``; check any other name."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    if name == "auto":
        # The only backend of this version; fused backends take precedence here as they are added.
        return "reference"
    if name in BACKENDS:
        return name
    if name in PLANNED:
        raise ValueError(
            f"backend {name!r} is not available in this version of gearsam_fused; available: {available_backends()}"
        )
    raise ValueError(f"unknown backend {name!r}; expected 'auto' or one of {available_backends()}")


def make_backend(name: str, blocks: list[list[torch.Tensor]], device: torch.device) -> Backend:
    return BACKENDS[resolve_backend_name(name, device)](blocks, device)
