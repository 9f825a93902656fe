"""``gearsam reproduce transfer`` and ``--weights``: ResNet-50 and EfficientNet-B0 hold torchvision's parameter names,
a state dict loads into them but for the classifier (and a wrong one is refused by name), an image folder is read
with Pillow (and a malformed one refused), and the study runs on CPU at tiny sizes both ways: from a source network it
pretrains once per seed on the digits, and from a weights file on an image folder."""

import collections
import dataclasses
import json
import pathlib

import numpy
import pytest
import torch
from PIL import Image
from test_cli import assert_real_plot, comparable, failed, gearsam, metrics, ok

from gearsam_fused.app import training
from gearsam_fused.app.cli import main
from gearsam_fused.app.data import as_float, keep_classes, load_dataset, load_image_folder, per_class
from gearsam_fused.app.studies import SOURCE, SOURCE_WEIGHTS, STUDIES, study_config, summarize_study
from gearsam_fused.app.training import RunConfig, make_optimizer
from gearsam_fused.app.weights import check_weights, classifier_of, load_backbone, read_weights, weights_path
from gearsam_fused.models import efficientnet_b0, resnet50

from doc_blocks import DOCS, python_blocks

TINY = ["--threads", "1"]


@pytest.fixture(autouse=True)
def _keep_threads():
    """The commands run here set torch's thread count (``--threads 1``); the tests after them get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# torchvision's names and shapes (torchvision/models/resnet.py and efficientnet.py), a few of each kind: stem,
# units, projections, squeeze-excitation, head, BatchNorm buffers.
TORCHVISION_RESNET50 = {
    "conv1.weight": (64, 3, 7, 7), "bn1.running_mean": (64,), "layer1.0.conv1.weight": (64, 64, 1, 1),
    "layer1.0.conv3.weight": (256, 64, 1, 1), "layer1.0.downsample.0.weight": (256, 64, 1, 1),
    "layer1.0.downsample.1.num_batches_tracked": (), "layer2.0.conv2.weight": (128, 128, 3, 3),
    "layer3.5.bn3.weight": (1024,), "layer4.0.downsample.0.weight": (2048, 1024, 1, 1),
    "layer4.2.bn3.running_var": (2048,), "fc.weight": (1000, 2048), "fc.bias": (1000,),
}  # fmt: skip
TORCHVISION_EFFICIENTNET_B0 = {
    "features.0.0.weight": (32, 3, 3, 3), "features.0.1.running_var": (32,),
    "features.1.0.block.0.0.weight": (32, 1, 3, 3), "features.1.0.block.1.fc1.weight": (8, 32, 1, 1),
    "features.1.0.block.2.0.weight": (16, 32, 1, 1), "features.2.0.block.0.0.weight": (96, 16, 1, 1),
    "features.2.0.block.2.fc2.bias": (96,), "features.6.3.block.3.1.weight": (192,),
    "features.7.0.block.3.0.weight": (320, 1152, 1, 1), "features.8.0.weight": (1280, 320, 1, 1),
    "classifier.1.weight": (1000, 1280), "classifier.1.bias": (1000,),
}  # fmt: skip


@pytest.mark.parametrize(("factory", "names", "size"), [
    (resnet50, TORCHVISION_RESNET50, (25_557_032, 161, 320)),
    (efficientnet_b0, TORCHVISION_EFFICIENTNET_B0, (5_288_548, 213, 360)),
])  # fmt: skip
def test_the_paper_backbones_have_torchvision_parameter_names(factory, names, size):
    """Sizes as torchvision states them (num_params of its weights' meta), and its names and shapes."""
    with torch.device("meta"):
        model = factory()
    state = model.state_dict()
    params = list(model.parameters())
    assert (sum(p.numel() for p in params), len(params), len(state)) == size
    assert {k: tuple(state[k].shape) for k in names} == names
    assert classifier_of(model) == ("fc" if factory is resnet50 else "classifier.1")


def test_efficientnet_drops_residual_branches_in_training_only():
    """torchvision's stochastic depth: 0 at the first block, growing to 0.2 * 15/16 at the last; none in eval mode."""
    model = efficientnet_b0(width_mult=0.25, num_classes=3)
    drops = [unit.stochastic_depth.p for stage in model.features[1:8] for unit in stage]
    assert drops[0] == 0.0 and drops[-1] == pytest.approx(0.2 * 15 / 16) and drops == sorted(drops)
    x = torch.randn(2, 3, 16, 16)
    model.eval()
    assert torch.equal(model(x), model(x))
    assert efficientnet_b0(width_mult=0.25, stochastic_depth=0.0).features[7][0].stochastic_depth.p == 0.0


def _save(state, path):
    torch.save(state, path)
    return path


def _trained(model):
    """``model`` with every parameter drawn anew (BatchNorm's too, which a fresh model has at 1 and 0): weights that
    no fresh model has, as a trained network's are."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


def test_weights_load_into_all_but_the_classifier(tmp_path):
    torch.manual_seed(0)
    source = _trained(resnet50(width=4, blocks=(1, 1, 1, 1), num_classes=7))
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")}  # an old file
    path = _save(state, tmp_path / "w.pt")
    torch.manual_seed(1)
    model = resnet50(width=4, blocks=(1, 1, 1, 1), num_classes=3)
    head = model.fc.weight.detach().clone()
    check_weights(model, read_weights(path), path, "resnet50")
    load_backbone(model, read_weights(path))
    for name, tensor in model.state_dict().items():
        if name.startswith("fc."):
            continue
        expected = source.state_dict()[name]
        assert torch.equal(tensor, expected), name
    assert torch.equal(model.fc.weight, head) and model.fc.weight.shape == (3, 128)  # fresh, for the 3 classes


def test_a_gearsam_checkpoint_gives_its_model(tmp_path):
    model = efficientnet_b0(width_mult=0.25, depth_mult=0.25, num_classes=5)
    path = _save({"model": model.state_dict(), "optimizer": {}, "epoch": 1}, tmp_path / "c.pt")
    assert read_weights(path).keys() == model.state_dict().keys()


@pytest.mark.parametrize(("make", "message"), [
    (lambda: efficientnet_b0(width_mult=0.25, num_classes=10).state_dict(),
     "is not a state dict of --model resnet50: it lacks 85 of the model's 85 tensors (conv1.weight, bn1.weight, "
     "bn1.bias, ... (82 more)); it holds 360 the model does not have (features.0.0.weight, "),
    (lambda: resnet50(width=8, blocks=(1, 1, 1, 1)).state_dict(),
     "does not fit --model resnet50 as built (--model-arg): "),
    (lambda: [torch.zeros(1)], "is not a state dict: expected a dict of parameter names to tensors"),
    (lambda: {"conv1.weight": pathlib.PurePosixPath("code")}, "refusing --weights"),
])  # fmt: skip
def test_weights_of_another_network_are_refused_by_name(tmp_path, make, message):
    path = _save(make(), tmp_path / "w.pt")
    with torch.device("meta"):
        model = resnet50(width=4, blocks=(1, 1, 1, 1), num_classes=3)
    with pytest.raises(ValueError) as caught:
        check_weights(model, read_weights(path), path, "resnet50")
    assert f"--weights {path}" in str(caught.value) and message in str(caught.value), str(caught.value)


def test_a_weights_path_per_seed_is_read_from_the_run_directory(tmp_path):
    assert weights_path("/w/source-{seed}.pt", 3, tmp_path) == pathlib.Path("/w/source-3.pt")
    assert weights_path(SOURCE_WEIGHTS, 2, tmp_path / "train_per_class=5") == (
        tmp_path / "source" / "checkpoints" / "sgd-seed2.pt"
    )
    with pytest.raises(ValueError, match="does not exist: pass a state dict file you have"):
        read_weights(tmp_path / "none.pt")


def test_classes_are_kept_relabelled_and_training_images_drawn_per_class():
    data = keep_classes(load_dataset("digits"), [7, 2])
    assert data.num_classes == 2 and set(data.train[1].tolist()) == {0, 1}
    full = load_dataset("digits")
    assert len(data.test[1]) == int((full.test[1] == 7).sum() + (full.test[1] == 2).sum())
    assert torch.equal(data.train[0][data.train[1] == 0], full.train[0][full.train[1] == 7])
    five, ten = (per_class(data.train[1], k, 2, seed=3) for k in (5, 10))
    assert torch.bincount(data.train[1][five]).tolist() == [5, 5] and set(five.tolist()) < set(ten.tolist())
    assert not torch.equal(per_class(data.train[1], 5, 2, seed=4), five)  # another seed, another draw
    assert len(per_class(data.train[1], 10_000, 2, seed=0)) == len(data.train[1])  # a class with fewer: all of it
    with pytest.raises(ValueError, match="digits has classes 0 to 9, not \\[10\\]"):
        keep_classes(full, [1, 10])


def make_image_folder(root, classes=("cat", "dog", "owl"), per_split=(4, 2), size=(40, 32)):
    """A tiny ImageFolder dataset: each class a colour, every image a little noisy, some not square."""
    gen = torch.Generator().manual_seed(0)
    for split, count in zip(("train", "test"), per_split):
        for index, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                colour = torch.zeros(size[1], size[0], 3)
                colour[..., index % 3] = 200
                pixels = (colour + 40 * torch.rand(size[1], size[0], 3, generator=gen)).clamp(0, 255).byte()
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.{'jpg' if i % 2 else 'png'}")
    return root


def test_an_image_folder_is_read_cropped_and_normalised(tmp_path):
    data = load_image_folder(str(make_image_folder(tmp_path / "d")), image_size=32)
    assert data.num_classes == 3 and data.train[0].dtype == torch.uint8 and data.train[0].shape == (12, 3, 32, 32)
    assert data.train[1].tolist() == [0] * 4 + [1] * 4 + [2] * 4 and data.test[0].shape == (6, 3, 32, 32)
    assert data.train[0][4, 1].float().mean() > 150 and data.train[0][4, 0].float().mean() < 60  # dog is green
    x = as_float(data.train[0][:2])
    assert x.dtype == torch.float32 and x[0, 0].mean() > 1.5  # (200/255 - 0.485) / 0.229, red in the red channel
    assert load_image_folder(str(tmp_path / "d"), image_size=32) is data  # read once per process


@pytest.mark.parametrize(("spoil", "message"), [
    (lambda root: (root / "test" / "owl").rename(root / "test" / "bat"),
     "train/ and test/ must hold the same class folders; only in train/: ['owl'], only in test/: ['bat']"),
    (lambda root: __import__("shutil").rmtree(root / "test"), "no test/ folder; expected train/CLASS/*.jpg"),
    (lambda root: [f.unlink() for f in (root / "train" / "dog").iterdir()],
     "1 class folder(s) of train/ hold no image (dog)"),
    (lambda root: (root / "train" / "cat" / "9.jpg").write_bytes(b"not an image"), "cannot read "),
])  # fmt: skip
def test_a_malformed_image_folder_is_refused_naming_what_is_wrong(tmp_path, spoil, message):
    root = make_image_folder(tmp_path / "d")
    spoil(root)
    with pytest.raises(ValueError) as caught:
        load_image_folder(str(root), image_size=32)
    assert message in str(caught.value)


def test_transfer_defaults_are_the_papers():
    cpu = study_config("transfer")
    assert (cpu.epochs, cpu.lr, cpu.schedule, cpu.momentum, cpu.weight_decay) == (30, 0.01, "cosine", 0.9, 1e-4)
    assert (cpu.rho, cpu.optimizer_rho, cpu.beta, cpu.batch_size) == (0.05, {"gear-sam": 0.2}, 0.9, 32)
    assert (cpu.dataset, cpu.model, cpu.classes, cpu.weights, cpu.seeds) == (
        "digits", "digits_resnet", [5, 6, 7, 8, 9], None, [0, 1, 2, 3, 4]
    )  # fmt: skip
    effnet = study_config("transfer", model="efficientnet_b0", weights="/w.pt", data_dir="/d")
    assert (effnet.dataset, effnet.batch_size, effnet.weight_decay, effnet.classes) == ("imagefolder", 128, 1e-5, None)
    assert study_config("transfer", model="resnet50", weights="/w.pt").weight_decay == 1e-4
    assert study_config("transfer", optimizer_rho={"sam": 0.1}).optimizer_rho == {"gear-sam": 0.2, "sam": 0.1}
    assert study_config("transfer", weight_decay=0.0).weight_decay == 0.0
    assert STUDIES["transfer"].values == (2, 5, 10, 20, 50, "all")


def test_each_optimizer_trains_at_its_own_radius():
    cfg = study_config("transfer")
    model = torch.nn.Linear(2, 2)
    radii = {name: make_optimizer(name, model, cfg).param_groups[0]["rho"] for name in ("sam", "gear-sam")}
    assert radii == {"sam": 0.05, "gear-sam": 0.2} and cfg.radii() == "0.05 (gear-sam 0.2)"


@pytest.mark.parametrize(("args", "message"), [
    (["reproduce", "transfer", "--train-per-class", "5"],
     "--train-per-class 5: the transfer study varies train_per_class itself; set its grid with --values"),
    (["reproduce", "transfer", "--values", "0", "all"],
     "train_per_class must be 'all' or an integer of at least 1 (training images per class), got 0, in --values"),
    (["reproduce", "transfer", "--optimizers", "sgd", "gear-sam", "--optimizer-rho", "sam=0.1"],
     "--optimizer-rho sam=0.1: not trained here (--optimizers sgd gear-sam)"),
    (["train", "--optimizers", "sgd", "sam", "--optimizer-rho", "sgd=0.1"],
     "--optimizer-rho sgd=0.1: sgd is not a two-pass sharpness-aware optimizer"),
    (["reproduce", "transfer", "--classes", *map(str, range(9))],
     "the transfer study fine-tunes the network of --weights PATH"),
    (["train", "--classes", "1", "1"], "--classes names [1] more than once"),
    (["reproduce", "transfer", "--weights", "nowhere.pt", "--model", "resnet50"],
     f"--weights {pathlib.Path('nowhere.pt').resolve()} does not exist: pass a state dict file you have"),
])  # fmt: skip
def test_transfer_settings_are_checked_before_anything_is_written(tmp_path, args, message):
    out = tmp_path / "out"
    failed(gearsam(*args, "--epochs", 1, "--seeds", 0, *TINY, "--out", out), message)
    assert not out.exists()


def _recording_reads(monkeypatch) -> list:
    """The weights files the runs start from, as read by the training loop."""
    read = []
    original = training.read_weights
    monkeypatch.setattr(training, "read_weights", lambda path: read.append(path) or original(path))
    return read


def test_the_study_pretrains_a_source_per_seed_and_fine_tunes_every_size_from_it(tmp_path, monkeypatch):
    out = tmp_path / "study"
    read = _recording_reads(monkeypatch)
    stdout = ok(gearsam("reproduce", "transfer", "--values", 2, 10, "--epochs", 1, "--seeds", 0, 1, *TINY,
                        "--out", out))  # fmt: skip
    source = json.loads((out / SOURCE / "config.json").read_text())
    assert (source["optimizers"], source["classes"], source["epochs"], source["weights"]) == (
        ["sgd"], [0, 1, 2, 3, 4], 15, None
    )  # fmt: skip
    assert [(r["optimizer"], r["seed"]) for r in metrics(out / SOURCE) if r["kind"] == "result"] == [
        ("sgd", 0), ("sgd", 1)
    ]  # fmt: skip
    checkpoints = {seed: out / SOURCE / "checkpoints" / f"sgd-seed{seed}.pt" for seed in (0, 1)}
    # every optimizer of every size started from its seed's source network, read from the source's checkpoint (and
    # read once more as each size's settings were checked)
    assert collections.Counter(map(str, read)) == {str(path): 2 * (1 + 3) for path in checkpoints.values()}
    for value, steps in ((2, 1), (10, 2)):  # 10 images: one batch of 32; 50: two
        config = json.loads((out / f"train_per_class={value}" / "config.json").read_text())
        assert (config["weights"], config["classes"], config["train_per_class"]) == (SOURCE_WEIGHTS, [5, 6, 7, 8, 9],
                                                                                     value)  # fmt: skip
        assert {r["step"] for r in metrics(out / f"train_per_class={value}") if r["kind"] == "result"} == {steps}
    numbers = json.loads((out / "study.json").read_text())
    assert numbers["complete"] and numbers["source"]["mean"] > 90 and numbers["source_settings"] == source
    assert [(r["value"], r["optimizer"]) for r in numbers["accuracy"]] == [
        (v, o) for v in (2, 10) for o in ("sgd", "sam", "gear-sam")
    ]  # fmt: skip
    text = (out / "study.md").read_text()
    assert "| train_per_class | SGD | SAM | GEAR-SAM | SAM − SGD | GEAR-SAM − SGD | GEAR-SAM − SAM |" in text
    assert "rho 0.05 (gear-sam 0.2)" in text and "Source: digits classes [0, 1, 2, 3, 4], SGD, 15 epochs" in text
    assert "| 10 |" in stdout and "weight decay 0.0001" in text
    assert_real_plot(out / "study.png")
    (out / "study.md").unlink()
    ok(gearsam("plot", out))
    assert (out / "study.md").read_text() == text


def test_an_interrupted_transfer_study_resumes_without_training_its_source_again(tmp_path, monkeypatch, capsys):
    args = ["reproduce", "transfer", "--values", "2", "5", "--optimizers", "sgd", "gear-sam", "--epochs", "2",
            "--seeds", "0", *map(str, TINY)]  # fmt: skip
    save = training._save_checkpoint

    def interrupted(run):
        save(run)
        if run.cfg.train_per_class == 5 and run.name == "gear-sam" and run.epoch == 1:
            raise KeyboardInterrupt

    assert main([*args, "--out", str(tmp_path / "straight")]) == 0
    monkeypatch.setattr(training, "_save_checkpoint", interrupted)
    assert main([*args, "--out", str(tmp_path / "cut")]) == 130
    monkeypatch.setattr(training, "_save_checkpoint", save)
    assert f"gearsam reproduce transfer --resume {tmp_path / 'cut'}" in capsys.readouterr().err
    cut = tmp_path / "cut"
    source = (cut / SOURCE / "metrics.jsonl").read_bytes()
    ok(gearsam("plot", cut))
    assert json.loads((cut / "study.json").read_text())["complete"] is False
    ok(gearsam("reproduce", "transfer", "--resume", cut, "--threads", 1))
    assert (cut / SOURCE / "metrics.jsonl").read_bytes() == source  # kept, not trained again
    for name in (SOURCE, "train_per_class=2", "train_per_class=5"):
        assert comparable(metrics(cut / name)) == comparable(metrics(tmp_path / "straight" / name))
    again, straight = (json.loads((d / "study.json").read_text()) for d in (cut, tmp_path / "straight"))
    assert again["complete"] and again["accuracy"] == straight["accuracy"] and again["source"] == straight["source"]


def test_the_study_fine_tunes_a_weights_file_on_an_image_folder(tmp_path, monkeypatch):
    """The GPU user's command on CPU: torchvision-named EfficientNet-B0 weights (random here), a tiny image folder,
    the paper's defaults but for the epochs and the image size."""
    torch.manual_seed(0)
    weights = _save(efficientnet_b0().state_dict(), tmp_path / "efficientnet_b0.pt")
    data = make_image_folder(tmp_path / "images")
    read = _recording_reads(monkeypatch)
    out = tmp_path / "study"
    stdout = ok(gearsam("reproduce", "transfer", "--model", "efficientnet_b0", "--weights", weights, "--data-dir",
                        data, "--image-size", 32, "--epochs", 1, "--seeds", 0, "--checkpoint-every", 0, *TINY,
                        "--out", out))  # fmt: skip
    config = json.loads((out / "train_per_class=all" / "config.json").read_text())
    assert (config["dataset"], config["weights"], config["image_size"], config["classes"]) == (
        "imagefolder", str(weights), 32, None
    )  # fmt: skip
    assert (config["batch_size"], config["lr"], config["weight_decay"], config["optimizer_rho"]) == (
        128, 0.01, 1e-5, {"gear-sam": 0.2}
    )  # fmt: skip
    assert not (out / SOURCE).exists() and read == [weights] * 5  # checked by the study, by the run, then 3 runs
    numbers = json.loads((out / "study.json").read_text())
    assert numbers["values"] == ["all"] and numbers["complete"] and "source_settings" not in numbers
    assert f"fine-tuned from --weights {weights}" in (out / "study.md").read_text() and "| all |" in stdout
    assert_real_plot(out / "study.png")


def test_train_from_weights_keeps_them_but_for_a_fresh_classifier(tmp_path):
    """``gearsam train --weights``: at a vanishing lr the trained parameters are the file's, the classifier the
    seed's own, sized for the image folder's three classes."""
    torch.manual_seed(0)
    source = _trained(resnet50(width=4, blocks=(1, 1, 1, 1)))
    weights = _save(source.state_dict(), tmp_path / "w.pt")
    run = tmp_path / "run"
    ok(gearsam("train", "--model", "resnet50", "--model-arg", "width=4", "--model-arg", "blocks=(1,1,1,1)",
               "--weights", weights, "--dataset", "imagefolder", "--data-dir", make_image_folder(tmp_path / "d"),
               "--image-size", 32, "--optimizers", "sgd", "--lr", 1e-30, "--weight-decay", 0, "--epochs", 1,
               "--checkpoint-every", 1, *TINY, "--out", run))  # fmt: skip
    trained = torch.load(run / "checkpoints" / "sgd-seed0.pt", weights_only=True)["model"]
    params = dict(source.named_parameters())
    for name, tensor in trained.items():
        if name.startswith("fc."):
            assert tensor.shape[0] == 3
        elif name in params:  # moved by at most lr times a gradient
            torch.testing.assert_close(tensor, params[name], rtol=0, atol=1e-20, msg=name)
    failed(gearsam("train", "--model", "efficientnet_b0", "--weights", weights, "--dataset", "imagefolder",
                   "--data-dir", tmp_path / "d", "--out", tmp_path / "bad"),
           f"--weights {weights} is not a state dict of --model efficientnet_b0")  # fmt: skip
    assert not (tmp_path / "bad").exists()


def test_summary_pairs_are_per_target_size():
    results = {size: [{"optimizer": o, "seed": s, "test_acc": 50.0 + 10 * i + s + (size == "all") * 30}
                      for i, o in enumerate(("sgd", "sam", "gear-sam")) for s in (0, 1)] for size in (2, "all")}  # fmt: skip
    numbers = summarize_study(STUDIES["transfer"], (2, "all"), ("sgd", "sam", "gear-sam"), results)
    pairs = {(p["value"], p["pair"]): p["mean"] for p in numbers["paired_differences"]}
    assert pairs == {(v, p): d for v in (2, "all") for p, d in
                     (("sam - sgd", 10.0), ("gear-sam - sgd", 20.0), ("gear-sam - sam", 10.0))}  # fmt: skip


def test_run_config_round_trips_the_transfer_settings(tmp_path):
    cfg = dataclasses.replace(study_config("transfer"), weights="/w-{seed}.pt", train_per_class=5)
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    assert RunConfig.load(tmp_path / "config.json") == cfg.validate()


def _layout_functions() -> dict:
    """The functions of docs/cli.md that lay out Flowers102, Stanford Cars and Oxford-IIIT Pet as image folders."""
    (code,) = [block for block in python_blocks(DOCS / "cli.md") if "def flowers102" in block]
    namespace: dict = {}
    exec(compile(code, "docs/cli.md", "exec"), namespace)
    return namespace


def _jpegs(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for index, name in enumerate(names):
        Image.new("RGB", (20, 16), (40 * index % 256, 90, 160)).save(folder / name)


def test_the_documented_layouts_make_image_folders_the_study_reads(tmp_path):
    """docs/cli.md's functions, on archives laid out as the datasets ship them (a few images each)."""
    from scipy.io import savemat

    layout = _layout_functions()
    flowers = tmp_path / "102flowers"
    _jpegs(flowers / "jpg", [f"image_{i:05d}.jpg" for i in range(1, 7)])
    savemat(flowers / "imagelabels.mat", {"labels": numpy.array([[1, 2, 1, 2, 1, 2]])})
    savemat(flowers / "setid.mat", {"trnid": numpy.array([[1, 2]]), "valid": numpy.array([[3, 4]]),
                                    "tstid": numpy.array([[5, 6]])})  # fmt: skip
    cars = tmp_path / "cars"
    _jpegs(cars / "cars_train", ["00001.jpg", "00002.jpg", "00003.jpg"])
    _jpegs(cars / "cars_test", ["00001.jpg", "00002.jpg", "00003.jpg"])
    (cars / "devkit").mkdir()
    annotations = numpy.dtype([("fname", object), ("class", object)])
    savemat(
        cars / "devkit" / "cars_train_annos.mat",
        {"annotations": numpy.array([("00001.jpg", 1), ("00002.jpg", 2), ("00003.jpg", 196)], dtype=annotations)},
    )
    savemat(cars / "cars_test_annos_withlabels.mat",
            {"annotations": numpy.array([("00001.jpg", 196), ("00002.jpg", 1), ("00003.jpg", 2)], dtype=annotations)})  # fmt: skip
    pets = tmp_path / "pets"
    _jpegs(pets / "images", ["Abyssinian_1.jpg", "Abyssinian_2.jpg", "beagle_1.jpg", "beagle_2.jpg"])
    (pets / "annotations").mkdir()
    (pets / "annotations" / "trainval.txt").write_text("Abyssinian_1 1 1 1\nbeagle_1 12 2 3\n")
    (pets / "annotations" / "test.txt").write_text("Abyssinian_2 1 1 1\nbeagle_2 12 2 3\n")
    layout["flowers102"](flowers, tmp_path / "f")
    layout["flowers102"](flowers, tmp_path / "f4", train=("trnid", "valid"))
    layout["stanford_cars"](cars, tmp_path / "c")
    layout["oxford_pets"](pets, tmp_path / "p")
    expected = {"f": (2, [0, 1], [0, 1]), "f4": (2, [0, 0, 1, 1], [0, 1]), "c": (3, [0, 1, 2], [0, 1, 2]),
                "p": (2, [0, 1], [0, 1])}  # fmt: skip
    for name, (classes, train, test) in expected.items():
        data = load_image_folder(str(tmp_path / name), image_size=16)
        assert (data.num_classes, sorted(data.train[1].tolist()), sorted(data.test[1].tolist())) == (classes, train,
                                                                                                     test), name  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "c" / "train").iterdir()) == ["001", "002", "196"]
