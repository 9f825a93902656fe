"""``gearsam reproduce`` and ``gearsam hessian`` at tiny settings: the numbers they write are those of the runs and
of the probe, and the figures are real plots."""

import json

import pytest
import torch
from test_cli import assert_real_plot, comparable, failed, gearsam, metrics, ok

from gearsam_fused.analysis import hessian_eigenvalues
from gearsam_fused.app.cli import main
from gearsam_fused.app.data import load_dataset
from gearsam_fused.app.probe import ProbeSettings, probe_run
from gearsam_fused.app.studies import STUDIES, study_config, summarize_study
from gearsam_fused.app.training import RunConfig, build_model


def test_paired_differences_are_per_seed():
    results = {0.2: [
        {"optimizer": "sgd", "seed": 0, "test_acc": 50.0}, {"optimizer": "sgd", "seed": 1, "test_acc": 70.0},
        {"optimizer": "sam", "seed": 0, "test_acc": 60.0}, {"optimizer": "sam", "seed": 1, "test_acc": 75.0},
    ]}  # fmt: skip
    numbers = summarize_study(STUDIES["label-noise"], (0.2,), ("sgd", "sam"), results)
    sgd, sam = numbers["accuracy"]
    assert (sgd["mean"], sam["mean"]) == pytest.approx((60.0, 67.5))
    assert sgd["std"] == pytest.approx(14.142135623730951)  # the seeds disagree by 20 points
    (pair,) = numbers["paired_differences"]
    assert pair["pair"] == "sam - sgd" and pair["per_seed"] == pytest.approx({"0": 10.0, "1": 5.0})
    assert (pair["mean"], pair["std"]) == pytest.approx((7.5, 3.5355339059327378))  # tighter than either spread


def test_reproduce_runs_the_grid_and_tables_the_runs(tmp_path):
    out = tmp_path / "study"
    args = ("reproduce", "label-noise", "--values", 0.0, 0.5, "--optimizers", "sgd", "gear-sam", "--epochs", 1,
            "--seeds", 0, 1, "--batch-size", 256, "--threads", 1, "--out", out)  # fmt: skip
    stdout = ok(gearsam(*args))
    numbers = json.loads((out / "study.json").read_text())
    assert numbers["setting"] == "label_noise"
    assert [(r["value"], r["optimizer"]) for r in numbers["accuracy"]] == [
        (0.0, "sgd"), (0.0, "gear-sam"), (0.5, "sgd"), (0.5, "gear-sam"),
    ]  # fmt: skip
    for row in numbers["accuracy"]:
        run_dir = out / f"label_noise={row['value']}"
        assert json.loads((run_dir / "config.json").read_text())["label_noise"] == row["value"]
        results = [r for r in metrics(run_dir) if r["kind"] == "result" and r["optimizer"] == row["optimizer"]]
        assert row["per_seed"] == {str(r["seed"]): r["test_acc"] for r in results}
    pairs = [(r["value"], r["pair"]) for r in numbers["paired_differences"]]
    assert pairs == [(0.0, "gear-sam - sgd"), (0.5, "gear-sam - sgd")]
    assert "| 0.5 | gear-sam - sgd |" in (out / "study.md").read_text() and "| 0.5 | gear-sam - sgd |" in stdout
    assert_real_plot(out / "study.png")


def test_reproduce_refuses_a_value_the_setting_cannot_take(tmp_path):
    failed(gearsam("reproduce", "partition", "--values", "blocks", "--epochs", 1, "--out", tmp_path / "x"),
           "partition must be one of")  # fmt: skip


def _probe(run_dir, cfg, data, optimizer: str, batch) -> list[float]:
    """The top two eigenvalues of the run's final weights of ``optimizer``, computed here by the library."""
    model = build_model(cfg, data)
    model.load_state_dict(torch.load(run_dir / "checkpoints" / f"{optimizer}-seed0.pt")["model"])
    return hessian_eigenvalues(model, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), [batch], 2,
                               max_iter=4, tol=ProbeSettings().tol, seed=0)  # fmt: skip


def test_hessian_probes_each_checkpoint_as_the_library_does(tmp_path):
    """``reproduce hessian`` trains, keeps the final weights and probes them; ``hessian RUN_DIR`` probes them again."""
    probe = ("--k", 2, "--max-iter", 4, "--trace-samples", 1, "--probe-batches", 1, "--probe-batch-size", 32)
    stdout = ok(gearsam("reproduce", "hessian", "--optimizers", "sgd", "sam", "--epochs", 1, "--seeds", 0,
                        "--batch-size", 256, "--threads", 1, *probe, "--out", tmp_path / "study"))  # fmt: skip
    run_dir = tmp_path / "study" / "label_noise=0.0"
    rows = [json.loads(line) for line in (run_dir / "hessian.jsonl").read_text().splitlines()]
    assert [(r["optimizer"], r["seed"]) for r in rows] == [("sgd", 0), ("sam", 0)]
    cfg = RunConfig.load(run_dir / "config.json")
    data = load_dataset(cfg.dataset, cfg.data_dir, cfg.synthetic_size)
    batch = tuple(t[:32] for t in data.test)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the run probed: float32 sums then add up in the same order
    try:
        expected = [_probe(run_dir, cfg, data, row["optimizer"], batch) for row in rows]
    finally:
        torch.set_num_threads(threads)
    for row, eigenvalues in zip(rows, expected):
        assert row["eigenvalues"] == pytest.approx(eigenvalues, rel=1e-5)
        assert row["max_eigenvalue"] == row["eigenvalues"][0] >= row["eigenvalues"][1]
    study = json.loads((tmp_path / "study" / "study.json").read_text())
    assert study["hessian"] == {"0.0": rows} and "top-2 mean" in stdout
    assert_real_plot(run_dir / "hessian.png")
    ok(gearsam("hessian", run_dir, "--k", 1, "--max-iter", 2, "--trace-samples", 1, "--probe-batches", 1))
    again = [json.loads(line) for line in (run_dir / "hessian.jsonl").read_text().splitlines()]
    assert [len(r["eigenvalues"]) for r in again] == [1, 1] and "top-1 mean" in (run_dir / "hessian.md").read_text()
    cut = gearsam("hessian", run_dir, "--k", 2, "--max-iter", 1, "--trace-samples", 1, "--probe-batches", 1)
    assert "gearsam: warning: 4 of 4 eigenvalues did not converge within --max-iter 1" in ok(cut) + cut.stderr
    rows = [json.loads(line) for line in (run_dir / "hessian.jsonl").read_text().splitlines()]
    assert all(r["converged"] == [False, False] and r["iterations"] == [1, 1] for r in rows)
    assert all(len(r["residuals"]) == 2 and min(r["residuals"]) > 0 for r in rows)
    table = (run_dir / "hessian.md").read_text()
    assert "residual" in table and table.count(" NO\n") == 4


def test_hessian_needs_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    ok(gearsam("demo", "--optimizers", "sgd", "--epochs", 1, "--seeds", 0, "--batch-size", 256, "--out", run_dir))
    failed(gearsam("hessian", run_dir), f"{run_dir} has no checkpoints: train with --checkpoint-every N")
    with pytest.raises(ValueError, match="is not a run directory"):
        probe_run(tmp_path, ProbeSettings())


def test_study_defaults_then_the_options_given():
    cfg = study_config("rho")
    assert (cfg.dataset, cfg.schedule, cfg.seeds, cfg.label_noise) == ("digits", "cosine", [0, 1, 2, 3, 4], 0.4)
    assert study_config("label-noise").label_noise == 0.0 and study_config("hessian").seeds == [0, 1, 2]
    given = study_config("beta", label_noise=0.0, seeds=[7])
    assert (given.label_noise, given.seeds, given.schedule) == (0.0, [7], "cosine")


def test_a_one_optimizer_study_compares_each_value_with_its_reference():
    accuracies = {"coarse": [80.0, 90.0], "global": [70.0, 85.0]}
    results = {
        value: [{"optimizer": "gear-sam", "seed": seed, "test_acc": acc} for seed, acc in enumerate(accs)]
        for value, accs in accuracies.items()
    }
    numbers = summarize_study(STUDIES["partition"], ("coarse", "global"), ("gear-sam",), results)
    (pair,) = numbers["paired_differences"]
    assert pair["value"] == "coarse" and pair["pair"] == "gear-sam - gear-sam at partition=global"
    assert pair["per_seed"] == pytest.approx({"0": 10.0, "1": 5.0})


@pytest.mark.parametrize(("study", "values", "message"), [
    ("label-noise", ("0", "1.5"), "label_noise must lie in [0.0, 1.0), got 1.5, in --values"),
    ("beta", ("1.0",), "beta must lie in [0.0, 1.0), got 1.0, in --values"),
])  # fmt: skip
def test_a_bad_value_anywhere_in_the_grid_fails_before_the_first_run(tmp_path, study, values, message):
    out = tmp_path / "study"
    failed(gearsam("reproduce", study, "--values", *values, "--epochs", 1, "--seeds", 0, "--out", out), message)
    assert not out.exists()
    failed(gearsam("reproduce", study, "--values", *values, "--epochs", 1, "--seeds", 0, cwd=tmp_path), message)
    assert not list(tmp_path.rglob("*=*"))  # no default study directory, no run directory of the good values


def test_an_interrupted_study_is_rebuilt_then_resumed_exactly(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of a run: one line says how to resume; ``plot`` summarizes what finished; ``--resume``
    keeps the finished runs untouched and continues the cut one from its checkpoint, ending as an uninterrupted study."""
    from gearsam_fused.app import training

    args = ["reproduce", "label-noise", "--values", "0.0", "0.5", "--optimizers", "sgd", "sam", "--epochs", "2",
            "--seeds", "0", "--batch-size", "256", "--threads", "1"]  # fmt: skip
    threads = torch.get_num_threads()
    save = training._save_checkpoint

    def interrupted(run):
        save(run)
        if run.cfg.label_noise == 0.5 and run.name == "sam" and run.epoch == 1:
            raise KeyboardInterrupt

    try:
        assert main([*args, "--out", str(tmp_path / "straight")]) == 0
        monkeypatch.setattr(training, "_save_checkpoint", interrupted)
        assert main([*args, "--out", str(tmp_path / "cut")]) == 130
        monkeypatch.setattr(training, "_save_checkpoint", save)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"gearsam: interrupted; {tmp_path / 'cut'} keeps the finished runs and the checkpoints; continue with: "
        f"gearsam reproduce label-noise --resume {tmp_path / 'cut'}"
    )
    cut = tmp_path / "cut"
    ok(gearsam("plot", cut))  # what finished: 0.0 for both, 0.5 for SGD only
    numbers = json.loads((cut / "study.json").read_text())
    assert numbers["complete"] is False and "**Incomplete**" in (cut / "study.md").read_text()
    assert [(r["value"], r["optimizer"]) for r in numbers["accuracy"]] == [(0.0, "sgd"), (0.0, "sam"), (0.5, "sgd")]
    assert_real_plot(cut / "study.png")
    kept = {name: (cut / name / "metrics.jsonl").read_bytes() for name in ("label_noise=0.0",)}
    failed(gearsam("reproduce", "label-noise", "--resume", cut, "--lr", 0.2), "--resume cannot change ['lr']")
    failed(gearsam("reproduce", "label-noise", "--out", cut), f"--out {cut} is not empty")
    ok(gearsam("reproduce", "label-noise", "--resume", cut, "--threads", 1))
    assert (cut / "label_noise=0.0" / "metrics.jsonl").read_bytes() == kept["label_noise=0.0"]  # not trained again
    for name in ("label_noise=0.0", "label_noise=0.5"):
        assert comparable(metrics(cut / name)) == comparable(metrics(tmp_path / "straight" / name))
    again, straight = (json.loads((d / "study.json").read_text()) for d in (cut, tmp_path / "straight"))
    assert again["complete"] and again["accuracy"] == straight["accuracy"]
    assert again["settings"]["epochs"] == 2 and again["settings"]["seeds"] == [0] and again["settings"]["lr"] == 0.05
    (cut / "study.md").unlink()
    (cut / "study.png").unlink()
    out = ok(gearsam("plot", cut))
    assert f"wrote {cut / 'study.png'}" in out and "| 0.5 | sam - sgd |" in (cut / "study.md").read_text()
    assert_real_plot(cut / "study.png")


def test_the_family_study_sets_each_variant_against_sgd_sam_and_gear_sam_on_noisy_labels():
    study, cfg = STUDIES["family"], study_config("family")
    family = ("gsam", "wsam", "friendly-sam", "gear-gsam")
    assert study.optimizers == ("sgd", "sam", "gear-sam", *family) and cfg.optimizers == list(study.optimizers)
    assert (study.setting, study.values, study.reference, study.baseline) == ("label_noise", (0.4,), None, None)
    assert (cfg.label_noise, cfg.seeds, cfg.epochs, cfg.schedule) == (0.4, [0, 1, 2, 3, 4], 15, "cosine")
    assert (cfg.seeds, cfg.label_noise) == (study_config("beta").seeds, study_config("beta").label_noise)
    results = {0.4: [{"optimizer": o, "seed": s, "test_acc": 80.0 + i + s} for i, o in enumerate(study.optimizers)
                     for s in (0, 1)]}  # fmt: skip
    numbers = summarize_study(study, study.values, study.optimizers, results)
    pairs = {p["pair"]: p for p in numbers["paired_differences"]}
    for i, name in enumerate(study.optimizers[1:], 1):  # each against SGD and, past SAM, against SAM: variant first
        assert pairs[f"{name} - sgd"]["per_seed"] == pytest.approx({"0": i, "1": i})
        assert name == "sam" or pairs[f"{name} - sam"]["mean"] == pytest.approx(i - 1)
    assert {"gear-gsam - gsam", "gear-gsam - gear-sam"} <= set(pairs) and len(pairs) == 21  # every pair once


def test_reproduce_family_trains_every_variant_at_the_study_label_noise(tmp_path):
    out = tmp_path / "study"
    ok(gearsam("reproduce", "family", "--epochs", 1, "--seeds", 0, "--batch-size", 256, "--threads", 1, "--out", out))
    optimizers = list(STUDIES["family"].optimizers)
    numbers = json.loads((out / "study.json").read_text())
    assert [(r["value"], r["optimizer"]) for r in numbers["accuracy"]] == [(0.4, o) for o in optimizers]
    config = json.loads((out / "label_noise=0.4" / "config.json").read_text())
    assert (config["label_noise"], config["optimizers"]) == (0.4, optimizers)
    text = (out / "study.md").read_text()
    assert "| 0.4 | friendly-sam - sam |" in text and "| 0.4 | gear-gsam - gear-sam |" in text
    assert_real_plot(out / "study.png")
