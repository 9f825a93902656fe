"""gearsam_fused: exact, fast sharpness-aware minimisation (SAM, ASAM, GEAR-SAM) for PyTorch."""

from .backends import available_backends
from .optim import GEARSAM, SAM
from .partition import Block, format_partition, partition
from .telemetry import BlockTelemetry

__version__ = "0.1.0"

__all__ = ["SAM", "GEARSAM", "partition", "Block", "format_partition", "available_backends", "BlockTelemetry", "__version__"]
