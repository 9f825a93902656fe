"""gearsam_fused: exact, fast sharpness-aware minimisation (SAM, ASAM, GEAR-SAM, GSAM, WSAM, F-SAM, one-pass momentum
SAM) for PyTorch."""

from ._version import MIN_TORCH, __version__
from .checks import check_torch_version

check_torch_version(MIN_TORCH)  # before anything below reaches for an API an older torch lacks

from .accumulation import accumulated_step  # noqa: E402
from .amp import SAMScaler, ScaledStepReport  # noqa: E402
from .backends import available_backends  # noqa: E402
from .base_step import get_state_debug_mode, set_state_debug_mode  # noqa: E402
from .bn import frozen_bn_stats, recompute_bn_stats  # noqa: E402
from .family import FriendlyAscent, SurrogateGap, WeightedSharpness  # noqa: E402
from .flat import compact_state_dict  # noqa: E402
from .momentum import MomentumSAM  # noqa: E402
from .optim import GEARSAM, GSAM, OPTIMIZERS, SAM, WSAM, FriendlySAM, SharpnessAware, StepStatistics  # noqa: E402
from .partition import Block, format_partition, partition  # noqa: E402
from .schedules import Adaptive, Every, LookSAM, Random, Schedule  # noqa: E402
from .telemetry import BlockTelemetry  # noqa: E402

__all__ = [
    "SAM", "GEARSAM", "GSAM", "WSAM", "FriendlySAM", "MomentumSAM", "FriendlyAscent", "SurrogateGap", "WeightedSharpness",
    "SharpnessAware", "StepStatistics", "OPTIMIZERS", "partition", "Block", "format_partition",
    "available_backends", "BlockTelemetry", "SAMScaler", "ScaledStepReport", "frozen_bn_stats", "recompute_bn_stats",
    "accumulated_step", "compact_state_dict", "set_state_debug_mode", "get_state_debug_mode", "Schedule", "Every",
    "LookSAM", "Random", "Adaptive", "__version__",
]  # fmt: skip
