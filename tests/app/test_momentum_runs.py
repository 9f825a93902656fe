"""One-pass momentum SAM in ``gearsam train``: evaluation and checkpoints see ``w``, not the look-ahead point the
parameters hold between steps; a run cut short resumes exactly; its names are checked before anything is written."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_cli import comparable, metrics

from gearsam_fused import MomentumSAM
from gearsam_fused.app import training
from gearsam_fused.app.cli import main
from gearsam_fused.app.data import load_dataset
from gearsam_fused.app.training import RunConfig, build_model, checkpoint_path, read_checkpoint, run_experiment

# the digits at 256 images a step, one thread: a second or two a run
CFG = RunConfig(dataset="digits", model="digits_resnet", optimizers=["momentum-gear-sam:1"], epochs=2, batch_size=256,
                threads=1, checkpoint_every=1, telemetry_every=4, lr=0.05)  # fmt: skip


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_evaluation_and_the_checkpoint_see_w(tmp_path):
    run_experiment(CFG, tmp_path, log=lambda *_: None)
    (result,) = [r for r in metrics(tmp_path) if r["kind"] == "result"]
    saved = read_checkpoint(checkpoint_path(tmp_path, CFG.optimizers[0], 0))
    data = load_dataset(CFG.dataset, None, CFG.synthetic_size)
    model = build_model(CFG, data)
    model.load_state_dict(saved["model"])
    model.eval()
    with torch.no_grad():
        images, labels = data.test
        loss = F.cross_entropy(model(images), labels)
    # the result's loss is the checkpoint's weights' own: both are w (the look-ahead point would give another loss)
    assert result["test_loss"] == pytest.approx(loss.item(), rel=1e-5)
    opt = saved["optimizer"]["param_groups"][0]["gearsam"]
    assert opt["one_pass"] and opt["training"] is False and "weights" not in opt  # saved in eval mode: w only

    # the look-ahead point is elsewhere: the check above could tell them apart
    optimizer = MomentumSAM(model, torch.optim.SGD, rho=1.0, allocation="gear", lr=0.05, momentum=0.9)
    optimizer.load_state_dict(saved["optimizer"])
    w = [p.detach().clone() for p in model.parameters()]
    optimizer.train()
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), w))
    assert moved > 1e-4


def test_a_one_pass_run_resumes_exactly(tmp_path):
    run_experiment(CFG, tmp_path / "straight", log=lambda *_: None)
    run_experiment(dataclasses.replace(CFG, epochs=1), tmp_path / "cut", log=lambda *_: None)
    run_experiment(CFG, tmp_path / "cut", resume=True, log=lambda *_: None)
    assert comparable(metrics(tmp_path / "cut")) == comparable(metrics(tmp_path / "straight"))


def test_a_one_pass_run_steps_once_a_batch_and_records_its_radii(tmp_path, monkeypatch):
    forward = training._forward
    passes = []

    def counting(model, x, y, cfg):
        passes.append(model.training)
        return forward(model, x, y, cfg)

    monkeypatch.setattr(training, "_forward", counting)
    cfg = dataclasses.replace(CFG, epochs=1, checkpoint_every=0, telemetry_every=1)
    run_experiment(cfg, tmp_path, log=lambda *_: None)
    rows = metrics(tmp_path)
    (result,) = [r for r in rows if r["kind"] == "result"]
    assert result["sam_steps"] == 0 and passes.count(True) == result["step"]  # one forward a step
    blocks = [r for r in rows if r["kind"] == "blocks"]
    assert [r["step"] for r in blocks] == list(range(1, result["step"] + 1))
    # GEAR-SAM's allocation: the look-ahead's block radii make up rho (1) in the sum of squares
    assert len(blocks[-1]["radius"]) > 1 and sum(r**2 for r in blocks[-1]["radius"]) == pytest.approx(1.0)


@pytest.mark.parametrize(("name", "why"), [
    ("momentum-sam:x", "optimizer 'momentum-sam:x': write momentum-sam:RHO with RHO a number >= 0"),
    ("momentum-sam:-1", "optimizer 'momentum-sam:-1': write momentum-sam:RHO with RHO a number >= 0"),
    ("momentum-sam:inf", "optimizer 'momentum-sam:inf': write momentum-sam:RHO with RHO a number >= 0"),
    ("momentum", "unknown optimizer 'momentum'"),
])  # fmt: skip
def test_a_bad_one_pass_name_is_refused_before_anything_is_written(capsys, tmp_path, name, why):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--optimizers", name, "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_name_without_radius_trains_at_momentum_rho():
    cfg = dataclasses.replace(CFG, momentum_rho=2.5)
    model = torch.nn.Linear(3, 2)
    plain = training.make_optimizer("momentum-sam", model, cfg)
    given = training.make_optimizer("momentum-sam:0.5", model, cfg)
    assert isinstance(plain, MomentumSAM) and plain.param_groups[0]["rho"] == 2.5 and plain.rule == "sam"
    assert given.param_groups[0]["rho"] == 0.5
    assert training.make_optimizer("momentum-gear-sam", model, cfg).rule == "gear-sam"
