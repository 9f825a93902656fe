"""``--weights PATH``: a run that starts from a trained network, as transfer learning does. The state dict at PATH
(torchvision's ImageNet weights of ``resnet50`` or ``efficientnet_b0``, or the model of a gearsam checkpoint) gives
every tensor of the model but its classifier, the last ``nn.Linear``, which is replaced: built for the run's classes
and initialised from the run's seed, as the rest of a fresh model would be. Every other tensor must be in the file,
under the model's own name and with its shape, and the file must hold nothing else; a BatchNorm's
``num_batches_tracked`` may be missing (state dicts saved before torch had it). Files are read with
``torch.load(weights_only=True)``: tensors and plain containers only, so nothing in them runs; nothing is downloaded.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
from torch import nn

#: The placeholder of a path that names one file per seed (the transfer study's source checkpoints).
SEED = "{seed}"


def weights_path(weights: str, seed: int, run_dir: Path | None = None) -> Path:
    """The file of ``--weights`` for ``seed``: ``{seed}`` in it replaced by the seed; a relative path is read from
    ``run_dir`` (the transfer study names its source checkpoints so, and the command line makes the paths it is
    given absolute)."""
    path = Path(weights.replace(SEED, str(seed)))
    # ``..`` taken away by name: the run directory need not exist yet (its settings are checked before it is made)
    return path if path.is_absolute() or run_dir is None else Path(os.path.normpath(Path(run_dir) / path))


def classifier_of(model: nn.Module) -> str:
    """The name of ``model``'s classifier: its last ``nn.Linear`` (``fc`` of a ResNet, ``classifier.1`` of an
    EfficientNet, ``head`` of a ViT); a ValueError for a model without one."""
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linear:
        raise ValueError(f"{type(model).__name__} has no nn.Linear to replace as its classifier: --weights fine-tunes "
                         "a network whose last linear layer is its classifier")  # fmt: skip
    return linear[-1]


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The state dict in ``path`` (a gearsam checkpoint's ``model``), read with ``torch.load(weights_only=True)``; a
    ValueError, naming the file, for a file that is missing, that holds more than tensors and plain containers
    (a pickle that would run code), or that is not a state dict."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--weights {path} does not exist: pass a state dict file you have (torchvision's ImageNet "
                         "weights of the model, say); nothing is downloaded")  # fmt: skip
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"refusing --weights {path}: it holds more than tensors and plain containers, so loading it "
                         "could execute code from the file; gearsam reads weights with torch.load(weights_only=True) "
                         "only") from exc  # fmt: skip
    except (RuntimeError, EOFError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else "the file ends early"
        raise ValueError(f"cannot read --weights {path} as a state dict: {type(exc).__name__}: {reason}") from exc
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict) and "optimizer" in saved:
        saved = saved["model"]  # a gearsam checkpoint: its model's weights
    if not (isinstance(saved, dict) and saved and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in saved.items())):  # fmt: skip
        raise ValueError(f"--weights {path} is not a state dict: expected a dict of parameter names to tensors, as "
                         "model.state_dict() saves it")  # fmt: skip
    return saved


def check_weights(model: nn.Module, state: dict[str, torch.Tensor], path: Path, model_name: str) -> None:
    """A ValueError, naming ``path`` and the tensors at fault, unless ``state`` has every tensor of ``model`` but its
    classifier's, by name and shape, and nothing else (a classifier of any size, and a missing BatchNorm
    ``num_batches_tracked``, are fine). ``model`` may live on the meta device: only names and shapes are read."""
    head = classifier_of(model) + "."
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(head)}
    given = {k: tuple(v.shape) for k, v in state.items() if not k.startswith(head)}
    missing = [k for k in expected if k not in given and not k.endswith(".num_batches_tracked")]
    unexpected = [k for k in given if k not in expected]
    if missing or unexpected:
        found = []
        if missing:
            counted = sum(not k.endswith(".num_batches_tracked") for k in expected)
            found.append(f"it lacks {len(missing)} of the model's {counted} tensors ({_some(missing)})")
        if unexpected:
            found.append(f"it holds {len(unexpected)} the model does not have ({_some(unexpected)})")
        raise ValueError(f"--weights {path} is not a state dict of --model {model_name}: {'; '.join(found)}. Pass "
                         f"the weights of {model_name} itself (for resnet50 and efficientnet_b0, torchvision's, whose "
                         "parameter names the in-repo models have)")  # fmt: skip
    shapes = [f"{k} {list(given[k])} where the model has {list(expected[k])}" for k in expected
              if k in given and given[k] != expected[k]]  # fmt: skip
    if shapes:
        raise ValueError(f"--weights {path} does not fit --model {model_name} as built (--model-arg): "
                         f"{len(shapes)} tensors differ in shape ({_some(shapes)})")  # fmt: skip


def load_backbone(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy every tensor of ``state`` but the classifier's into ``model`` (checked by :func:`check_weights`): the
    classifier keeps the fresh weights it was built with."""
    head = classifier_of(model) + "."
    kept = {k: v for k, v in state.items() if not k.startswith(head)}
    missing, unexpected = model.load_state_dict(kept, strict=False)
    left = [k for k in missing if not k.startswith(head)]
    if left or unexpected:  # check_weights has refused such a file: this is a safeguard, not an expected error
        raise ValueError(f"the weights do not fit the model: missing {_some(left)}, unexpected {_some(unexpected)}")


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")
