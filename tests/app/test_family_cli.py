"""The SAM family on the command line: the names of ``--optimizers`` build the library's variants at their authors'
defaults, a second-pass schedule is refused in the command's words, and a tiny run of each trains."""

import io

import pytest
from test_cli import TINY_TRAIN, gearsam, metrics, ok
from torch import nn

from gearsam_fused import GEARSAM, GSAM, SAM, WSAM, FriendlyAscent, FriendlySAM, SurrogateGap, WeightedSharpness
from gearsam_fused.app.cli import main
from gearsam_fused.app.demo import demo_config
from gearsam_fused.app.training import FAMILY, OPTIMIZER_NAMES, RunConfig, make_optimizer, run_experiment


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _parts(opt) -> tuple:
    """The optimizer's ascent and descent as (class, settings) pairs; None for SAM's own."""
    return tuple(None if part is None else (type(part), vars(part)) for part in (opt.ascent, opt.descent))


GSAM_DESCENT = (SurrogateGap, {"alpha": 0.4, "eps": 1e-12})


@pytest.mark.parametrize(("name", "cls", "ascent", "descent"), [
    ("gsam", GSAM, None, GSAM_DESCENT),
    ("wsam", WSAM, None, (WeightedSharpness, {"gamma": 0.9, "decouple": True, "weight": pytest.approx(9.0)})),
    ("friendly-sam", FriendlySAM, (FriendlyAscent, {"sigma": 1.0, "lmbda": 0.9}), None),
    ("gear-gsam", GEARSAM, None, GSAM_DESCENT),
    ("sam", SAM, None, None),  # the existing names build what they built
    ("gear-sam", GEARSAM, None, None),
])  # fmt: skip
def test_each_name_builds_its_optimizer_with_its_part(name, cls, ascent, descent):
    cfg = RunConfig(lr=0.03, rho=0.07, beta=0.8, momentum=0.5, weight_decay=0.0)
    opt = make_optimizer(name, _tiny(), cfg)
    assert type(opt) is cls and _parts(opt) == (ascent, descent)
    assert opt.param_groups[0]["rho"] == 0.07 and opt.base_optimizer.param_groups[0]["lr"] == 0.03
    assert opt.base_optimizer.param_groups[0]["momentum"] == 0.5
    assert opt.schedule is None
    if cls is GEARSAM:  # the run's beta, for GEAR-SAM's allocation under GSAM's descent too
        assert opt.beta == 0.8


def test_the_family_is_offered_beside_the_existing_names_and_the_demo_trains_what_it_trained():
    assert OPTIMIZER_NAMES == (
        "sgd",
        "sam",
        "gear-sam",
        "gsam",
        "wsam",
        "friendly-sam",
        "gear-gsam",
        "momentum-sam",
        "momentum-gear-sam",
    )
    assert set(FAMILY) == {"gsam", "wsam", "friendly-sam", "gear-gsam"}
    assert demo_config().optimizers == ["sgd", "sam", "gear-sam"]


@pytest.mark.parametrize(("args", "family"), [
    (["train", "--optimizers", "sam", "wsam", "gear-gsam", "--second-pass", "looksam:5"], "wsam, gear-gsam"),
    (["reproduce", "family", "--second-pass", "looksam:2:0.5"], "gsam, wsam, friendly-sam, gear-gsam"),
])  # fmt: skip
def test_looksam_with_a_family_method_is_refused_naming_both(capsys, tmp_path, args, family):
    spec = args[args.index("--second-pass") + 1]
    assert main([*args, "--epochs", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    message = (f"gearsam: error: --second-pass {spec} cannot correct the skipped steps of {family}: LookSAM's "
               "correction keeps the first gradient in the buffer their descent keeps it in (and an ascent replaces "
               "it); drop them from --optimizers or use every:K, random:P or adaptive")  # fmt: skip
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_an_energy_schedule_with_an_ascent_is_refused_naming_it(capsys, tmp_path):
    assert main(["train", "--optimizers", "gsam", "friendly-sam", "--second-pass", "adaptive:0.5", "--epochs", "1",
                 "--out", str(tmp_path / "out")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    message = ("gearsam: error: --second-pass adaptive:0.5 cannot schedule friendly-sam: it decides from the first "
               "gradient's energy, which F-SAM's ascent replaces on its SAM steps; drop them from --optimizers or use "
               "every:K or random:P")  # fmt: skip
    assert message in err and "Traceback" not in err, err


def test_a_family_method_skips_the_second_pass_as_its_schedule_says(tmp_path):
    run_dir = tmp_path / "run"
    ok(gearsam("train", "--optimizers", "gsam", "friendly-sam", "--second-pass", "every:2", "--epochs", 1, "--seeds",
               0, *TINY_TRAIN, "--out", run_dir))  # fmt: skip
    rows = metrics(run_dir)
    results = {r["optimizer"]: r for r in rows if r["kind"] == "result"}
    assert set(results) == {"gsam", "friendly-sam"}
    for name, result in results.items():
        assert result["step"] == 4 and result["sam_steps"] == 2, (name, result)


def test_each_family_method_trains_every_step_with_both_passes(tmp_path):
    run_dir = tmp_path / "run"
    ok(gearsam("train", "--optimizers", *FAMILY, "--epochs", 1, "--seeds", 0, *TINY_TRAIN, "--out", run_dir))
    rows = metrics(run_dir)
    results = {r["optimizer"]: r for r in rows if r["kind"] == "result"}
    assert set(results) == set(FAMILY)
    for name, result in results.items():
        assert result["sam_steps"] == result["step"] == 4 and 0.0 <= result["test_acc"] <= 100.0
        (epoch,) = [r for r in rows if r["kind"] == "epoch" and r["optimizer"] == name]
        assert epoch["train_sharpness"] is not None and epoch["sam_fraction"] == 1.0
        assert any(r["kind"] == "blocks" and r["optimizer"] == name for r in rows)  # the block telemetry ran
    summary = (run_dir / "summary.md").read_text()
    assert all(f"\n{name} " in summary for name in FAMILY)


def test_a_family_run_resumes_exactly_from_its_checkpoints(tmp_path):
    """F-SAM's gradient average and the kept first gradient travel in the checkpoints: one epoch, then a second
    after --resume, ends where two straight epochs end."""
    tiny = dict(model_args={"width": 4, "blocks": (1, 1)}, synthetic_size=64, batch_size=16, threads=1,
                optimizers=list(FAMILY), checkpoint_every=1)  # fmt: skip
    quiet = dict(log=lambda *_: None, stream=io.StringIO())
    run_experiment(RunConfig(epochs=2, **tiny), tmp_path / "straight", **quiet)
    run_experiment(RunConfig(epochs=1, **tiny), tmp_path / "resumed", **quiet)
    run_experiment(RunConfig(epochs=2, **tiny), tmp_path / "resumed", resume=True, **quiet)

    def finals(run_dir):
        return {r["optimizer"]: r["test_loss"] for r in metrics(run_dir) if r["kind"] == "result" and r["epochs"] == 2}

    assert finals(tmp_path / "resumed") == finals(tmp_path / "straight") and len(finals(tmp_path / "straight")) == 4
