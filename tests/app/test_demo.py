"""``gearsam demo`` at tiny settings (two epochs, two seeds): its table, its reading, the metrics it writes and its
plots. What the demo shows at its own settings is in docs/index.md; here, that it reports the run it trained."""

import math
import re

import pytest
from test_cli import EPOCH_FIELDS, RESULT_FIELDS, assert_real_plot, gearsam, metrics, ok, table_rows

from gearsam_fused.app.demo import DEMO, demo_config, demo_curves_figure, demo_reading, demo_run_config, demo_table
from gearsam_fused.app.metrics import METRIC_KINDS
from gearsam_fused.app.studies import study_config
from gearsam_fused.app.training import RunConfig
from gearsam_fused.telemetry import RECORD_FIELDS


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    args = ("demo", "--epochs", 2, "--seeds", 0, 1, "--threads", 1, "--telemetry-every", 7, "--out", run_dir)
    return run_dir, ok(gearsam(*args))


def results(run_dir) -> dict[str, dict[int, dict]]:
    """The result rows of a run directory, by optimizer and seed."""
    found = {}
    for r in metrics(run_dir):
        if r["kind"] == "result":
            found.setdefault(r["optimizer"], {})[r["seed"]] = r
    return found


def test_demo_prints_its_table_from_the_runs(demo_run):
    run_dir, stdout = demo_run
    assert stdout.startswith("digits: 1438 train / 359 test images") and "label noise=40%" in stdout
    rows, runs = table_rows(stdout), results(run_dir)
    assert list(rows) == ["sgd", "sam", "gear-sam"]
    mean = {name: {key: sum(r[key] for r in seeds.values()) / 2 for key in ("test_acc", "cpu_seconds")}
            for name, seeds in runs.items()}  # fmt: skip
    for name, cells in rows.items():
        accuracy, plus_minus, spread, *rest = cells
        assert float(accuracy) == pytest.approx(mean[name]["test_acc"], abs=0.005) and plus_minus == "±"
        assert float(spread) >= 0.0
        if name == "sgd":
            assert rest[0] == "-"
            rest = rest[1:]
        else:  # the mean of the same-seed differences, and its spread
            diffs = [runs[name][seed]["test_acc"] - runs["sgd"][seed]["test_acc"] for seed in (0, 1)]
            assert float(rest[0]) == pytest.approx(sum(diffs) / 2, abs=0.005) and rest[1] == "±"
            assert float(rest[2]) == pytest.approx(abs(diffs[0] - diffs[1]) / math.sqrt(2), abs=0.005)
            rest = rest[3:]
        seconds, unit, *ratio = rest  # CPU time of the training, not wall clock
        assert float(seconds) == pytest.approx(mean[name]["cpu_seconds"], abs=0.05) and unit == "s"
        if name != "sgd":
            shown = float(re.fullmatch(r"\((\d+\.\d)x", ratio[0])[1])
            assert shown == pytest.approx(mean[name]["cpu_seconds"] / mean["sgd"]["cpu_seconds"], abs=0.05)
    assert "CPU time" in stdout and "time / run (s)" not in stdout  # the demo's table, not the wall-clock one
    summary = (run_dir / "summary.md").read_text()
    lines = stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("optimizer"))) :][:5]
    assert "\n".join(table) in summary and "Measured 20" in summary and "cores" in summary


def test_demo_ends_with_a_reading_of_its_run(demo_run):
    run_dir, stdout = demo_run
    (reading,) = [line for line in stdout.splitlines() if line.startswith("Reading:")]
    assert stdout.splitlines().index(reading) == len(stdout.splitlines()) - 3  # then the two "wrote" lines
    assert reading in (run_dir / "summary.md").read_text()
    assert reading.startswith("Reading: with 40% of the training labels flipped, GEAR-SAM ")
    runs = results(run_dir)
    for title, name in (("GEAR-SAM", "gear-sam"), ("SAM", "sam")):
        diffs = [runs[name][seed]["test_acc"] - runs["sgd"][seed]["test_acc"] for seed in (0, 1)]
        mean = sum(diffs) / 2
        said = re.search(rf"(?<!-){title} (?:ends )?(\d+\.\d) points (above|below)", reading)
        if round(mean, 1) == 0:
            assert f"{title} ends level with SGD" in reading or f"{title} level with SGD" in reading
        else:
            assert said and float(said[1]) == pytest.approx(abs(mean), abs=0.051)
            assert said[2] == ("above" if mean > 0 else "below")
        assert f"(ahead on {sum(d > 0 for d in diffs)} of 2 seeds)" in reading
    assert reading.endswith("over 2 seeds (0, 1).")


def test_the_reading_claims_no_more_than_the_run():
    def row(name, seed, accuracy, cpu):
        return {"optimizer": name, "seed": seed, "test_acc": accuracy, "cpu_seconds": cpu}

    one = [row("sgd", 0, 80.0, 2.0), row("sam", 0, 95.04, 4.0), row("gear-sam", 0, 79.0, 3.8)]
    reading = demo_reading(one, demo_run_config(seeds=[0]))
    assert reading == ("Reading: with 40% of the training labels flipped, GEAR-SAM ends 1.0 points below SGD in test "
                       "accuracy and SAM 15.0 points above, for 1.9x and 2.0x SGD's training CPU time; one seed (0), a "
                       "single draw, not an average (--seeds 0 1 2 trains more).")  # fmt: skip
    clean = demo_run_config(seeds=[0], label_noise=0.0, optimizers=["sgd", "sam"])
    assert demo_reading([row("sgd", 0, 99.0, 2.0), row("sam", 0, 99.02, 4.0)], clean).startswith(
        "Reading: on clean labels, SAM ends level with SGD in test accuracy, for 2.0x"
    )
    alone = demo_run_config(optimizers=["sgd"])
    assert demo_reading([row("sgd", 0, 99.0, 2.0)], alone).startswith("Reading: none;")
    assert "n/a" in demo_table(one, ["sgd", "sam", "gear-sam"])  # one seed has no spread


def test_the_demo_trains_on_noisy_labels_and_the_studies_keep_their_settings():
    cfg = demo_run_config()
    assert (cfg.label_noise, cfg.schedule, cfg.threads) == (0.4, "cosine", 1)
    assert cfg.optimizers == ["sgd", "sam", "gear-sam"]
    assert demo_run_config(rho=0.05).rho == 0.05  # the options given come last
    # the clean-label settings the studies build on stay theirs: the demo's own are its command's alone
    baseline = {
        "label_noise": 0.0,
        "rho": 0.05,
        "schedule": "constant",
        "epochs": 15,
        "seeds": [0, 1, 2],
        "threads": None,
    }
    assert {k: getattr(demo_config(), k) for k in DEMO} == baseline
    hessian = study_config("hessian")
    assert (hessian.label_noise, hessian.rho, hessian.epochs, hessian.threads) == (0.0, 0.05, 15, None)


def test_demo_writes_documented_metrics(demo_run):
    run_dir, _ = demo_run
    rows = metrics(run_dir)
    assert {r["kind"] for r in rows} == set(METRIC_KINDS)
    steps_per_epoch = math.ceil(1438 / 64)  # digits training split / batch size
    for r in rows:
        assert r["optimizer"] in ("sgd", "sam", "gear-sam") and r["seed"] in (0, 1)
        if r["kind"] == "epoch":
            assert set(r) == EPOCH_FIELDS and r["step"] == r["epoch"] * steps_per_epoch
            assert 0.0 <= r["train_acc"] <= 100.0 and r["train_loss"] > 0 and r["seconds"] > 0
            assert (r["train_sharpness"] is None) == (r["optimizer"] == "sgd")
        elif r["kind"] == "result":
            assert set(r) == RESULT_FIELDS and r["epochs"] == 2
        else:
            assert set(r) == {"kind", "optimizer", "seed", *RECORD_FIELDS} and r["optimizer"] != "sgd"
            assert r["blocks"] == ["stem", "layer1", "layer2", "layer3", "classifier"]
            assert all(len(r[k]) == 5 for k in ("energy", "score", "radius", "share"))
            assert sum(r["share"]) == pytest.approx(1.0, abs=1e-9) and r["rho"] == 0.2
            assert r["sharpness"] == pytest.approx(r["perturbed_loss"] - r["loss"], abs=0) and r["loss"] > 0
    assert sum(r["kind"] == "epoch" for r in rows) == 3 * 2 * 2 and sum(r["kind"] == "result" for r in rows) == 6
    for name in ("sam", "gear-sam"):
        for seed in (0, 1):
            steps = [r["step"] for r in rows if r["kind"] == "blocks" and (r["optimizer"], r["seed"]) == (name, seed)]
            assert steps == list(range(1, 2 * steps_per_epoch + 1))  # every step once, in order
            # the epoch's realized sharpness is the per-image mean of its steps' (batches of 64, the last of 30)
            sizes = [64] * (steps_per_epoch - 1) + [1438 - 64 * (steps_per_epoch - 1)]
            blocks = [r for r in rows if r["kind"] == "blocks" and (r["optimizer"], r["seed"]) == (name, seed)]
            epoch_rows = [r for r in rows if r["kind"] == "epoch" and (r["optimizer"], r["seed"]) == (name, seed)]
            for epoch in epoch_rows:
                mine = blocks[(epoch["epoch"] - 1) * steps_per_epoch : epoch["epoch"] * steps_per_epoch]
                mean = sum(size * r["sharpness"] for size, r in zip(sizes, mine)) / 1438
                assert epoch["train_sharpness"] == pytest.approx(mean, rel=1e-4, abs=1e-7)
    # the allocation rules are visible in the records: GEAR-SAM's score is an EMA, SAM's the block gradient norm
    first = {r["optimizer"]: r for r in rows if r["kind"] == "blocks" and r["step"] == 1 and r["seed"] == 0}
    assert first["sam"]["score"] == pytest.approx([math.sqrt(e) for e in first["sam"]["energy"]], rel=1e-12)
    assert first["gear-sam"]["score"] == pytest.approx([0.1 * e for e in first["gear-sam"]["energy"]], rel=1e-12)
    cfg = RunConfig.load(run_dir / "config.json")
    assert cfg.command == "demo" and cfg.dataset == "digits" and cfg.seeds == [0, 1] and cfg.epochs == 2
    assert (cfg.label_noise, cfg.rho, cfg.schedule, cfg.threads) == (0.4, 0.2, "cosine", 1)


def test_demo_zooms_its_accuracy_panels_and_labels_the_final_values(demo_run):
    run_dir, _ = demo_run
    epochs = [r for r in metrics(run_dir) if r["kind"] == "epoch"]
    figure = demo_curves_figure(epochs, 0.4)
    panels = {ax.get_title(): ax for ax in figure.axes}
    for title, key in (("train accuracy on the noisy labels (%)", "train_acc"), ("test accuracy (%)", "test_acc")):
        ax = panels[title]
        values = [r[key] for r in epochs] + ([60.0] if key == "train_acc" else [])  # 60%: the labels left unflipped
        bottom, top = ax.get_ylim()
        assert bottom <= min(values) and max(values) <= top  # every curve and band in view ...
        assert top - bottom < 1.3 * (max(values) - min(values)) + 2.5  # ... zoomed to them, not 0-100
        finals = {}
        for r in epochs:
            if r["epoch"] == 2:
                finals.setdefault(r["optimizer"], []).append(r[key])
        labels = {text.get_text() for text in ax.texts}
        assert {f"{sum(v) / len(v):.1f}" for v in finals.values()} <= labels  # each optimizer's final value
    assert figure.get_suptitle() == "40% of the training labels flipped; mean over 2 seeds (band: min to max)"


def test_demo_writes_plots_and_plot_renders_them_again(demo_run):
    run_dir, stdout = demo_run
    for name in ("curves.png", "block_shares.png"):
        assert f"wrote {run_dir / name}" in stdout
        assert_real_plot(run_dir / name)
        (run_dir / name).unlink()
    out = ok(gearsam("plot", run_dir))
    for name in ("curves.png", "block_shares.png"):
        assert f"wrote {run_dir / name}" in out
        assert_real_plot(run_dir / name)
