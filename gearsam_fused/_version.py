"""The package's version and the oldest torch it supports: the one place both are written. ``setup.py`` reads this
file without importing the package (whose import needs torch)."""

__version__ = "0.1.0"

#: The oldest torch release gearsam_fused supports: ``SAMScaler`` builds on ``torch.amp.GradScaler`` and its
#: per-optimizer records (``torch.amp.grad_scaler``), which torch 2.3 introduced; every other torch API the package
#: uses is older.
MIN_TORCH = "2.3"
