"""The README's Python examples run as written (given a model and a loader), so the documentation stays true."""

import re
from pathlib import Path

import torch

from gearsam_fused.models import resnet18

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 3
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    namespace = {"model": resnet18(width=4), "loader": [(x, y)], "x": x, "y": y}
    # run elsewhere: test_ddp.py runs the DDP loop under two processes, test_fsdp.py the FSDP2 block (a process
    # group), test_transformers.py and test_lightning.py the integrations' blocks (optional packages),
    # test_capturable.py the CUDA graph (a GPU)
    elsewhere = [code for code in blocks if code.startswith("# needs:")]
    assert len(elsewhere) == 5
    for code in blocks:
        if code not in elsewhere:
            exec(compile(code, str(README), "exec"), namespace)
    assert namespace["opt"].block_names == ["stem", "layer1", "layer2", "layer3", "layer4", "classifier"]
    assert torch.isfinite(namespace["loss_at_perturbed_point"])
