"""Checkpoints are tensors and plain containers, read with ``torch.load(weights_only=True)``: ``--resume`` and
``gearsam hessian`` run nothing a file in a run directory holds, and refuse a file that would run code before they
write anything."""

import enum
import json
import pickle
import shutil

import pytest
import torch
from test_cli import TINY_TRAIN, failed, gearsam, ok

from gearsam_fused.app.training import CHECKPOINT_KEYS, check_plain, checkpoint_path, read_checkpoint

OPTIMIZERS = ("sgd", "gear-sam")
PROBE = ("--k", 1, "--max-iter", 2, "--trace-samples", 1, "--probe-batches", 1, "--probe-batch-size", 16)


class WritesAFile:
    """An object whose unpickling calls ``exec``, which creates ``path``: what a hostile checkpoint could run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').close()",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run directory of one epoch with a checkpoint per optimizer."""
    run_dir = tmp_path_factory.mktemp("checkpoints") / "run"
    ok(gearsam("train", *TINY_TRAIN, "--optimizers", *OPTIMIZERS, "--checkpoint-every", 1, "--out", run_dir))
    return run_dir


def test_a_checkpoint_holds_tensors_and_plain_containers_and_is_probed(trained, tmp_path):
    """(``test_cli``'s, ``test_family_cli``'s, ``test_momentum_runs``' and ``test_efficiency_study``'s resumed runs
    equal uninterrupted ones, their checkpoints read as here.)"""
    run_dir = shutil.copytree(trained, tmp_path / "run")
    for name in OPTIMIZERS:
        saved = read_checkpoint(checkpoint_path(run_dir, name, 0))
        assert tuple(saved) == CHECKPOINT_KEYS
        check_plain(saved)
        assert torch.load(checkpoint_path(run_dir, name, 0), weights_only=True)["step"] == 4
    ok(gearsam("hessian", run_dir, *PROBE))
    rows = [json.loads(line) for line in (run_dir / "hessian.jsonl").read_text().splitlines()]
    assert [r["optimizer"] for r in rows] == list(OPTIMIZERS)


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_a_checkpoint_that_would_run_code_is_refused_and_nothing_runs(trained, tmp_path, writer):
    """A checkpoint replaced by a pickle that calls ``exec`` when loaded, written by ``torch.save`` or as a plain
    pickle (torch's legacy format reads one): ``--resume`` and ``hessian`` name the file and refuse it, the file's
    code never runs and the run directory is left as it was."""
    run_dir = shutil.copytree(trained, tmp_path / "run")
    marker = tmp_path / "code-ran"
    path = checkpoint_path(run_dir, OPTIMIZERS[-1], 0)
    hostile = {**{key: 0 for key in CHECKPOINT_KEYS}, "model": WritesAFile(marker)}
    if writer == "torch.save":
        torch.save(hostile, path)
    else:
        path.write_bytes(pickle.dumps(hostile, protocol=2))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    refusal = f"refusing {path}: it is not a checkpoint gearsam wrote. Its pickle asks to call exec, so loading it "
    refusal += "would execute code from the file"
    failed(gearsam("train", "--resume", run_dir, "--epochs", 2, "--threads", 1), refusal)
    assert not marker.exists()
    failed(gearsam("hessian", run_dir, *PROBE), refusal)
    assert not marker.exists()
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # nothing written, nothing resumed


def test_a_file_that_is_no_checkpoint_is_refused(tmp_path):
    path = tmp_path / "junk.pt"
    torch.save({"model": {}}, path)
    truncated = path.read_bytes()[:-100]
    for content in (b"", b"not a checkpoint", truncated):
        path.write_bytes(content)
        with pytest.raises(
            ValueError, match=f"(cannot read {path} as a gearsam checkpoint|refusing {path}: it is not)"
        ):
            read_checkpoint(path)
    torch.save({"model": {}}, path)
    with pytest.raises(ValueError, match=r"is not a checkpoint gearsam wrote: it lacks \['epoch', "):
        read_checkpoint(path)
    assert read_checkpoint(path, keys=("model",)) == {"model": {}}  # all the Hessian probe reads


def test_an_entry_weights_only_would_refuse_is_refused_when_saved():
    class Mode(enum.Enum):
        EVAL = 1

    check_plain({"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"step": 1.0}}, "shapes": [(2, 3)]}})
    with pytest.raises(TypeError, match=r"checkpoint\['optimizer'\]\['state'\]\[0\]\['mode'\] is a .*Mode"):
        check_plain({"optimizer": {"state": {0: {"mode": Mode.EVAL}}}})
