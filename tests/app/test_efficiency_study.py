"""``gearsam train --second-pass`` and ``gearsam reproduce efficiency`` at tiny settings: every form of the option
parses into the library's schedule and bad ones are refused by name; a scheduled run skips the second pass where its
schedule says so (counted from its own metrics and from the forward passes it runs); the study's table and figure
hold the numbers of its runs' metrics."""

import dataclasses
import json
import math
import statistics

import pytest
import torch
from test_cli import assert_real_plot, comparable, metrics

from gearsam_fused import Adaptive, Every, LookSAM, Random
from gearsam_fused.app import training
from gearsam_fused.app.cli import _config, build_parser, main
from gearsam_fused.app.studies import STUDIES, run_name
from gearsam_fused.app.training import RunConfig, run_experiment, second_pass_schedule

# The digits at 256 images a step: 6 steps an epoch (1438 training images), a second or two a run on one thread.
TINY = ["--batch-size", "256", "--threads", "1"]
STEPS_PER_EPOCH = math.ceil(1438 / 256)
# one of the efficiency study's one-pass momentum SAM configurations
ONE_PASS = "momentum-sam:1"


@pytest.fixture(autouse=True)
def _keep_threads():
    """The commands run here set torch's thread count (``--threads 1``); the tests after them get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("spec", "schedule"), [
    ("always", None),
    ("every:1", Every(1)),
    ("every:2", Every(2)),
    ("looksam:5", LookSAM(5, 0.7)),
    ("looksam:5:0.25", LookSAM(5, 0.25)),
    ("random:0.3", Random(0.3, 7)),
    ("adaptive", Adaptive(0.0)),
    ("adaptive:0.5", Adaptive(0.5)),
    ("adaptive:-1", Adaptive(-1.0)),
])  # fmt: skip
def test_every_form_of_second_pass_parses_into_its_schedule(spec, schedule):
    assert second_pass_schedule(spec, seed=7) == schedule
    args = build_parser().parse_args(["train", "--optimizers", "sam", "gear-sam", "--second-pass", spec])
    cfg, _, _ = _config(args)
    assert cfg.second_pass == spec and cfg.validate() is cfg  # stored as written, in config.json and for --resume
    sam = training.make_optimizer("sam", torch.nn.Linear(2, 2), cfg, seed=7)
    assert sam.schedule == schedule


@pytest.mark.parametrize(("spec", "why"), [
    ("sometimes", "unknown schedule 'sometimes'"),
    ("every", "write every as every:K"),
    ("every:0", "K must be an integer of at least 1"),
    ("every:2.5", "K must be an integer of at least 1"),
    ("every:2:3", "write every as every:K"),
    ("looksam:x", "K must be an integer of at least 1"),
    ("looksam:2:-0.5", "alpha must lie in"),
    ("looksam:2:nan", "alpha must be a finite real number"),
    ("random:1.5", "P must lie in [0, 1]"),
    ("random", "write random as random:P"),
    ("adaptive:inf", "c must be a finite real number"),
    ("always:2", "always takes no value"),
])  # fmt: skip
def test_a_bad_second_pass_is_refused_by_name_before_anything_is_written(capsys, tmp_path, spec, why):
    out = tmp_path / "run"
    assert main(["train", "--optimizers", "sam", "--second-pass", spec, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"gearsam: error: --second-pass {spec}: {why}" in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize(("args", "message"), [
    (["train", "--optimizers", "sgd", "sam", "--second-pass", "every:2"],
     "--second-pass every:2 schedules the second pass of the two-pass sharpness-aware optimizers; sgd has none: drop "
     "it from --optimizers"),
    (["train", "--optimizers", "sam", "momentum-sam", "--second-pass", "every:2"],
     "--second-pass every:2 schedules the second pass of the two-pass sharpness-aware optimizers; momentum-sam has "
     "none: drop it from --optimizers"),
    (["train", "--adaptive", "--second-pass", "looksam:2"],
     "--second-pass looksam:2: LookSAM's correction is defined for plain gradients, not ASAM's; drop --adaptive"),
    (["reproduce", "efficiency", "--second-pass", "every:2"],
     "--second-pass every:2: the efficiency study varies second_pass itself; set its grid with --values"),
    (["reproduce", "efficiency", "--values", "always", "every:0"],
     "second_pass every:0: K must be an integer of at least 1"),
])  # fmt: skip
def test_second_pass_is_refused_where_it_cannot_apply(capsys, tmp_path, args, message):
    assert main([*args, "--epochs", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"gearsam: error: {message}" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_every_2_takes_half_the_second_passes(tmp_path, monkeypatch):
    """Counted three ways: the steps the metrics mark as SAM steps, their counts per epoch and run, and the forward
    passes the training loop ran (one per step, plus one per second pass)."""
    forward = training._forward
    passes = []

    def counting(model, x, y, cfg):
        passes.append(model.training)  # evaluation runs in eval mode
        return forward(model, x, y, cfg)

    monkeypatch.setattr(training, "_forward", counting)
    assert main(["train", "--dataset", "digits", "--model", "digits_resnet", "--optimizers", "sam", "--second-pass",
                 "every:2", "--epochs", "2", *TINY, "--out", str(tmp_path / "run")]) == 0  # fmt: skip
    rows = metrics(tmp_path / "run")
    steps = 2 * STEPS_PER_EPOCH
    blocks = [r for r in rows if r["kind"] == "blocks"]
    assert [r["step"] for r in blocks] == list(range(1, steps + 1))
    assert [r["sam_step"] for r in blocks] == [step % 2 == 1 for step in range(1, steps + 1)]  # steps 0, 2, 4, ...
    assert all((r["sharpness"] is None) != r["sam_step"] for r in blocks)  # no second loss without a second pass
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["sam_steps"] for r in epochs] == [STEPS_PER_EPOCH // 2, steps // 2]
    assert [r["sam_fraction"] for r in epochs] == [0.5, 0.5]
    assert all(r["epoch_seconds"] > 0 and r["cpu_seconds"] > 0 for r in epochs)
    (result,) = [r for r in rows if r["kind"] == "result"]
    assert (result["step"], result["sam_steps"]) == (steps, steps // 2)
    assert passes.count(True) == steps + steps // 2
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "sam every:2" in summary and "second passes" in summary and "50%" in summary
    assert json.loads((tmp_path / "run" / "config.json").read_text())["second_pass"] == "every:2"


def test_a_scheduled_run_resumes_exactly(tmp_path):
    """The adaptive schedule's statistics travel in the checkpoint: cut after one epoch and resumed, the run takes
    the same steps, second passes included, as one trained straight through."""
    cfg = RunConfig(dataset="digits", model="digits_resnet", optimizers=["gear-sam"], second_pass="adaptive",
                    epochs=2, batch_size=256, threads=1, checkpoint_every=1, telemetry_every=4)  # fmt: skip
    run_experiment(cfg, tmp_path / "straight", log=lambda *_: None)
    run_experiment(dataclasses.replace(cfg, epochs=1), tmp_path / "cut", log=lambda *_: None)
    run_experiment(cfg, tmp_path / "cut", resume=True, log=lambda *_: None)
    straight, cut = metrics(tmp_path / "straight"), metrics(tmp_path / "cut")
    timings = {"epoch_seconds", "cpu_seconds"}
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timings} for r in comparable(rows)]  # noqa: E731
    assert strip(cut) == strip(straight)
    decisions = [r["sam_step"] for r in straight if r["kind"] == "blocks"]
    assert decisions[:2] == [True, True] and not all(decisions)  # AE-SAM skipped some steps


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("efficiency") / "study"
    threads = torch.get_num_threads()
    try:
        code = main(["reproduce", "efficiency", "--values", "always", "every:2", "--optimizers", "sgd", "sam",
                     ONE_PASS, "--epochs", "1", "--seeds", "0", "1", *TINY, "--out", str(out)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return out


def _results(study, value) -> dict:
    """The result rows of the study's run directory of ``value``, by optimizer and seed."""
    rows = metrics(study / run_name("second_pass", value))
    return {(r["optimizer"], r["seed"]): r for r in rows if r["kind"] == "result"}


def test_efficiency_study_tables_the_runs_own_numbers(tiny_study):
    full, every = _results(tiny_study, "always"), _results(tiny_study, "every:2")
    # SGD and one-pass momentum SAM, which have no second pass to schedule, at the reference only
    assert sorted(full) == [(ONE_PASS, 0), (ONE_PASS, 1), ("sam", 0), ("sam", 1), ("sgd", 0), ("sgd", 1)]
    assert sorted(every) == [("sam", 0), ("sam", 1)]
    assert not (tiny_study / "second_pass=every:2").exists()  # no colon in a path
    numbers = json.loads((tiny_study / "study.json").read_text())
    assert numbers["complete"] and numbers["machines"][0]["cpu_count"] >= 1 and numbers["machines"][0]["date"]
    configurations = {("always", "sgd"): full, ("always", "sam"): full, ("always", ONE_PASS): full,
                      ("every:2", "sam"): every}  # fmt: skip
    accuracy = {(r["value"], r["optimizer"]): r for r in numbers["accuracy"]}
    costs = {(r["value"], r["optimizer"]): r for r in numbers["costs"]}
    assert list(accuracy) == list(configurations) and list(costs) == list(configurations)
    text = (tiny_study / "study.md").read_text()
    for (value, name), results in configurations.items():
        accs = [results[(name, seed)]["test_acc"] for seed in (0, 1)]
        assert accuracy[(value, name)]["mean"] == pytest.approx(statistics.mean(accs))
        assert accuracy[(value, name)]["std"] == pytest.approx(statistics.stdev(accs))
        shares = [results[(name, seed)]["sam_steps"] / results[(name, seed)]["step"] for seed in (0, 1)]
        assert costs[(value, name)]["second_passes"]["mean"] == pytest.approx(statistics.mean(shares))
        ratios = [results[(name, seed)]["seconds"] / full[("sgd", seed)]["seconds"] for seed in (0, 1)]
        assert costs[(value, name)]["time_ratio"]["mean"] == pytest.approx(statistics.mean(ratios))
        label = name if value == "always" else f"{name} {value}"
        row = f"| {label} | {100 * statistics.mean(shares):.1f} | {statistics.mean(ratios):.2f} ± "
        assert row in text
        assert f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f}" in text.split(row)[1].splitlines()[0]
    assert costs[("always", "sgd")]["second_passes"]["mean"] == 0.0
    assert costs[("always", "sam")]["second_passes"]["mean"] == 1.0
    assert costs[("always", ONE_PASS)]["second_passes"]["mean"] == 0.0
    assert costs[("every:2", "sam")]["second_passes"]["mean"] == pytest.approx(3 / STEPS_PER_EPOCH)  # steps 0, 2, 4
    pairs = {(r["value"], r["pair"]): r for r in numbers["paired_differences"]}
    differences = {
        ("every:2", "sam - sam at second_pass=always"): [every[("sam", s)]["test_acc"] - full[("sam", s)]["test_acc"]
                                                         for s in (0, 1)],
        ("every:2", "sam - sgd at second_pass=always"): [every[("sam", s)]["test_acc"] - full[("sgd", s)]["test_acc"]
                                                         for s in (0, 1)],
        ("always", "sam - sgd"): [full[("sam", s)]["test_acc"] - full[("sgd", s)]["test_acc"] for s in (0, 1)],
        ("always", f"{ONE_PASS} - sgd"): [full[(ONE_PASS, s)]["test_acc"] - full[("sgd", s)]["test_acc"]
                                         for s in (0, 1)],
        ("always", f"{ONE_PASS} - sam"): [full[(ONE_PASS, s)]["test_acc"] - full[("sam", s)]["test_acc"]
                                         for s in (0, 1)],
    }  # fmt: skip
    assert set(pairs) == set(differences)
    for key, per_seed in differences.items():
        assert pairs[key]["mean"] == pytest.approx(statistics.mean(per_seed))
        assert pairs[key]["std"] == pytest.approx(statistics.stdev(per_seed))
    line = next(line for line in text.splitlines() if line.startswith("| sam every:2 |"))
    mean, std = statistics.mean(differences[key := ("every:2", "sam - sam at second_pass=always")]), pairs[key]["std"]
    assert f"| {mean:+.2f} ± {std:.2f} |" in line
    assert "Run on 20" in text and "cores" in text and "wall clock" in text  # machine, date, how time was measured
    assert_real_plot(tiny_study / "study.png")


def test_efficiency_study_is_rebuilt_from_its_runs(tiny_study, capsys):
    before = json.loads((tiny_study / "study.json").read_text())
    text = (tiny_study / "study.md").read_text()
    (tiny_study / "study.md").unlink()
    (tiny_study / "study.png").unlink()
    assert main(["plot", str(tiny_study)]) == 0
    assert (tiny_study / "study.md").read_text() == text
    assert json.loads((tiny_study / "study.json").read_text()) == before
    assert_real_plot(tiny_study / "study.png")
    capsys.readouterr()


def test_the_efficiency_study_trains_sgd_once_and_every_schedule_of_both_rules():
    study = STUDIES["efficiency"]
    assert study.setting == "second_pass" and study.reference == "always" and study.baseline == "sgd"
    assert set(study.values) >= {"always", "every:2", "every:5", "every:10", "looksam:2", "looksam:5", "looksam:10",
                                 "adaptive"}  # fmt: skip
    one_pass = [o for o in study.optimizers if o.startswith("momentum-")]
    radii = {float(o.partition(":")[2]) for o in one_pass}
    assert {o.partition(":")[0] for o in one_pass} == {"momentum-sam", "momentum-gear-sam"}
    assert min(radii) <= 0.1 and max(radii) >= 3  # wide enough to find the best radius on either side of 1
    for value in study.values:
        second_pass_schedule(value)  # every value is a valid --second-pass
        trained = study.trained_at(value, study.optimizers)
        assert ("sgd" in trained) == (value == "always")
        assert all((o in trained) == (value == "always") for o in one_pass)
