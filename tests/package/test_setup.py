"""setup.py's build switches, each in a real ``pip install`` of a copy of the source tree: a missing or failing
compiler leaves a working pure-Python install with a warning, a forced part that cannot be built fails with a
message that says why, a bad switch value is refused, and a wheel without the extension is pure Python. Also the
version and the torch minimum, each written once."""

import importlib.metadata
import runpy
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _source(tmp_path: Path) -> Path:
    """A copy of what a build reads."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    skip = shutil.ignore_patterns("__pycache__", "*.so")
    for name in ("gearsam_fused", "triton_kernels", "csrc"):
        shutil.copytree(ROOT / name, source / name, ignore=skip)
    return source


def _pip_install(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    source, target = _source(tmp_path), tmp_path / "target"
    command = [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--no-index",
               "--target", str(target), str(source)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**_environ(), **env})
    return done, target / "gearsam_fused"


def _stand_in_compiler(tmp_path: Path, calls: Path) -> Path:
    """A compiler that records its arguments, refuses -fopenmp, compiles setup.py's probe and answers version queries
    as the real one, and fails every other compile."""
    compiler = tmp_path / "c++"
    compiler.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\ncase " $* " in *" -fopenmp "*) exit 1;; esac\n'
        'case "$*" in *probe.cpp*) exec c++ "$@";; esac\n'
        'case "$1" in -v|--version|-dumpversion|-dumpfullversion) exec c++ "$@";; esac\nexit 1\n'
    )
    compiler.chmod(0o755)
    return compiler


def _environ() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("GEARSAM_BUILD")}


@pytest.mark.heavy  # a pip install a case: the default tier runs one
@pytest.mark.parametrize("cxx, why", [("no-such-compiler", "no C++ compiler"), ("false", "no working C++ compiler")])
def test_without_a_working_compiler_the_install_is_pure_python(tmp_path, cxx, why):
    done, package = _pip_install(tmp_path, CXX=cxx)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"not building the C++ extension: {why}" in done.stdout + done.stderr
    assert (package / "optim.py").is_file() and (package / "triton_kernels" / "perturb.py").is_file()
    assert not list(package.glob("_C*.so"))


@pytest.mark.full  # a build or a benchmark run beyond the representative one the default tier keeps
@pytest.mark.parametrize(
    "env, message",
    [
        (
            dict(CXX="no-such-compiler", GEARSAM_BUILD_CPP="1"),
            "GEARSAM_BUILD_CPP=1 but the C++ extension cannot be built: no C++ compiler",
        ),
        (dict(GEARSAM_BUILD_CPP="maybe"), "GEARSAM_BUILD_CPP must be auto, 0 or 1, got 'maybe'"),
        (dict(GEARSAM_DEBUG="auto"), "GEARSAM_DEBUG must be 0 or 1, got 'auto'"),
        pytest.param(
            dict(GEARSAM_BUILD_CUDA="1"),
            "GEARSAM_BUILD_CUDA=1 but the CUDA kernels cannot be built: this torch is a CPU-only build",
            marks=pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build"),
        ),
    ],
)
def test_a_forced_part_that_cannot_be_built_fails_and_says_why(tmp_path, env, message):
    done, package = _pip_install(tmp_path, **env)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr
    assert not package.exists()


@pytest.mark.full  # a build or a benchmark run beyond the representative one the default tier keeps
def test_a_compiler_without_openmp_gets_no_openmp_flag(tmp_path):
    """-fopenmp is passed only where the compiler accepts it. The stand-in compiler builds the probe only, so the
    install ends pure-Python."""
    calls = tmp_path / "calls.txt"
    compiler = _stand_in_compiler(tmp_path, calls)
    done, package = _pip_install(tmp_path, CXX=str(compiler), GEARSAM_BUILD_CUDA="0")
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "rejects -fopenmp, so the CPU kernels run on one thread" in output
    assert "not building the C++ extension: the build failed" in output
    probe, *later = [line.split() for line in calls.read_text().splitlines()]
    assert "-fopenmp" in probe
    compiles = [args for args in later if "-c" in args and any(a.endswith(".cpp") for a in args)]
    assert compiles and not any("-fopenmp" in args for args in compiles)


@pytest.mark.full  # a build or a benchmark run beyond the representative one the default tier keeps
def test_a_wheel_whose_extension_failed_to_build_is_pure_python(tmp_path):
    """Tagged py3-none-any, and without the extension an earlier build left in build/ (planted here)."""
    source = _source(tmp_path)
    platlib = source / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "gearsam_fused"
    platlib.mkdir(parents=True)
    (platlib / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"an earlier build's extension")
    compiler = _stand_in_compiler(tmp_path, tmp_path / "calls.txt")
    command = [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "--no-index",
               "-w", str(tmp_path / "wheels"), str(source)]  # fmt: skip
    env = {**_environ(), "CXX": str(compiler), "GEARSAM_BUILD_CUDA": "0"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not building the C++ extension: the build failed" in done.stdout + done.stderr
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gearsam_fused/optim.py" in names and not [n for n in names if "_C" in n and n.endswith((".so", ".pyd"))]


def test_version_and_torch_minimum_are_written_once():
    about = runpy.run_path(str(ROOT / "gearsam_fused" / "_version.py"))
    import gearsam_fused

    assert gearsam_fused.__version__ == about["__version__"]
    assert importlib.metadata.version("gearsam_fused") == about["__version__"]
    assert f"torch>={about['MIN_TORCH']}" in importlib.metadata.requires("gearsam_fused")
    assert not any(
        line.lstrip().startswith(('version="', "__version__ ="))
        for line in (ROOT / "setup.py").read_text().splitlines()
    )


def test_an_older_torch_is_refused_at_import():
    """The import names the minimum instead of failing later on a missing torch API (simulated: the installed torch
    reports an older version)."""
    code = "import torch; torch.__version__ = '2.2.2+cpu'; import gearsam_fused"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ImportError: gearsam_fused needs torch >= 2.3, but torch 2.2.2+cpu is installed" in done.stderr
    assert subprocess.run([sys.executable, "-c", "import gearsam_fused"], timeout=120).returncode == 0
