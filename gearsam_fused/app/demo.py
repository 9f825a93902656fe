"""The main job: SGD, SAM and GEAR-SAM side by side on a real dataset that ships offline.

scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes) train a small three-stage ResNet in
seconds on a CPU; every optimizer sees the same seeds, split, initial weights and batch order.
"""

from __future__ import annotations

from .training import PAPER, RunConfig


def demo_config(**overrides) -> RunConfig:
    """The demo's settings: digits, the five-block ``digits_resnet``, 15 epochs, three seeds, constant lr 0.05."""
    settings = dict(
        command="demo", dataset="digits", model="digits_resnet", optimizers=list(PAPER), seeds=[0, 1, 2],
        epochs=15, batch_size=64, lr=0.05, rho=0.05, beta=0.9, telemetry_every=25,
    )  # fmt: skip
    settings.update(overrides)
    return RunConfig(**settings)
