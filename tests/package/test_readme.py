"""The Python examples of the README and of the documentation pages run as written (given a model and a loader), so
the documentation stays true. Each page runs in a namespace of its own."""

import pytest
import torch

from gearsam_fused import GSAM, MomentumSAM
from gearsam_fused.models import resnet18

from doc_blocks import NEEDS, README, name, needs_blocks, pages, python_blocks

RESNET_BLOCKS = ["stem", "layer1", "layer2", "layer3", "layer4", "classifier"]


def run_page(page) -> dict:
    """Every block of ``page`` but the ``# needs:`` ones, in order, in one namespace that starts with a small
    ResNet-18, a one-batch loader and that batch, and with dynamo's caches empty: a page is a program of its own, and
    what other tests compiled would count towards the recompile limit of the code it compiles."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    namespace = {"model": resnet18(width=4), "loader": [(x, y)], "x": x, "y": y}
    for code in python_blocks(page):
        if not code.startswith(NEEDS):
            exec(compile(code, name(page), "exec"), namespace)
    return namespace


def test_the_blocks_that_need_more_are_run_elsewhere():
    # test_ddp.py runs the DDP loop under two processes, test_fsdp.py the FSDP2 block (a process group),
    # test_transformers.py and test_lightning.py the integrations' blocks (optional packages), test_capturable.py the
    # CUDA graph (a GPU); each finds its block by its first line (doc_blocks.needs_block)
    found = {code.splitlines()[0]: where for code, where in needs_blocks()}
    assert len(needs_blocks()) == len(found) == 5, found
    assert found == {
        "# needs: torch.distributed (run one process per GPU, e.g. with torchrun)": "docs/distributed.md",
        "# needs: torch.distributed and FSDP2 (one process per GPU, e.g. with torchrun, after dist.init_process_group)": (
            "docs/distributed.md"
        ),
        "# needs: transformers": "docs/integrations.md",
        "# needs: lightning": "docs/integrations.md",
        "# needs: a CUDA GPU": "docs/usage.md",
    }


def test_readme_python_examples_run():
    assert len(python_blocks(README)) >= 2
    namespace = run_page(README)
    assert namespace["opt"].block_names == RESNET_BLOCKS


def check_usage(namespace):
    assert namespace["opt"].block_names == RESNET_BLOCKS
    assert torch.isfinite(namespace["loss_at_perturbed_point"])
    assert len(namespace["top"]) == 2 and namespace["top"][0] >= namespace["top"][1]
    assert isinstance(namespace["gsam"], GSAM)
    msam = namespace["msam"]
    assert isinstance(msam, MomentumSAM) and msam.training and msam.step_statistics.rho == 1.0
    assert torch.isfinite(namespace["test_loss"])


def check_training(namespace):
    assert namespace["opt"].block_names == RESNET_BLOCKS
    assert not namespace["report"].skipped
    assert torch.isfinite(torch.as_tensor(namespace["loss"]))


def check_cli(namespace):
    # the image-folder layouts of the transfer study's datasets: tests/app/test_transfer.py runs them on fake archives
    assert all(callable(namespace[f]) for f in ("flowers102", "stanford_cars", "oxford_pets"))


#: what each page's examples leave behind, beyond having run
CHECKS = {"README.md": None, "docs/usage.md": check_usage, "docs/training.md": check_training, "docs/cli.md": check_cli}


@pytest.mark.parametrize("page", [p for p in pages() if p != README], ids=name)
def test_docs_python_examples_run(page):
    runnable = [code for code in python_blocks(page) if not code.startswith(NEEDS)]
    if not runnable:
        assert name(page) not in CHECKS
        return
    assert name(page) in CHECKS, f"{name(page)} has examples: add what they leave behind to CHECKS"
    CHECKS[name(page)](run_page(page))
