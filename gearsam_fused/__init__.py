"""gearsam_fused: exact, fast sharpness-aware minimisation (SAM, ASAM, GEAR-SAM) for PyTorch."""

from .accumulation import accumulated_step
from .amp import SAMScaler, ScaledStepReport
from .backends import available_backends
from .bn import frozen_bn_stats
from .flat import compact_state_dict
from .optim import GEARSAM, SAM
from .partition import Block, format_partition, partition
from .telemetry import BlockTelemetry

__version__ = "0.1.0"

__all__ = [
    "SAM", "GEARSAM", "partition", "Block", "format_partition", "available_backends", "BlockTelemetry", "SAMScaler",
    "ScaledStepReport", "frozen_bn_stats", "accumulated_step", "compact_state_dict", "__version__",
]  # fmt: skip
