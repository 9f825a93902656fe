"""Mutation check of the test suite's default tier: does it catch every small bug the full tier catches?

Each mutation below changes one formula of the library (a sign, an operand, a dropped term) in one implementation:
the reference backend, the torch backend, the Triton kernels, the C++ CPU kernels (``csrc/cpu``) or the frontend.
For each, on a copy of the working tree (the checkout itself is never touched):

1. the mutation is applied (``old`` must occur exactly once in its file), and where it changes ``csrc/`` the
   extension is rebuilt in the copy (``GEARSAM_BUILD_CPP=1 python setup.py build_ext --inplace``; a failed build is
   reported, not counted);
2. the default tier runs on the mutation's ``targets`` (``pytest -x``); a failing test catches it;
3. if they do not catch it, the default tier runs on the whole ``tests`` folder (its subfolders, the targets' first),
   then, if it still survives, the full tier (``--full``) on the targets.

The verdict is "default catches", "only full catches" (a gap in the default tier's selection), "neither catches" (a
gap in the suite) or an error. Every catching test is run again, alone, on the unmutated copy: a test that fails
there too catches nothing. The table is written to ``tests/quality/mutations.md`` after each mutation (an
interrupted run keeps what it found) and printed at the end; a run of some mutations (``--only``) rewrites their rows
and keeps the others'.

Run from anywhere, in the environment that runs the tests (torch, triton, a C++ compiler and ninja)::

    python tests/quality/mutations.py                  # every mutation (about 40 min on two busy cores)
    python tests/quality/mutations.py --list           # the mutations, without running anything
    python tests/quality/mutations.py --only ID[,ID]   # some of them
    python tests/quality/mutations.py --keep           # keep the copy (its path is printed)
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORT = Path(__file__).with_name("mutations.md")
EXTENSION_GLOB = "gearsam_fused/_C*.so"
#: Seconds one pytest run may take before it is stopped and reported as an error.
PYTEST_TIMEOUT = 3600
BUILD_TIMEOUT = 1800
#: The test folders by how directly they check the formulas: the order of the whole-folder run after the targets'.
FOLDER_ORDER = ("tests/kernels", "tests/optimizer", "tests/library", "tests/distributed", "tests/integrations",
                "tests/app", "tests/benchmarks", "tests/package")  # fmt: skip


@dataclass(frozen=True)
class Mutation:
    id: str
    description: str
    file: str
    old: str
    new: str
    targets: tuple[str, ...]


SAM_KERNELS = "tests/kernels/test_sam_kernels.py"
BASE_STEP = "tests/kernels/test_base_step.py"
CORRECTION = "tests/kernels/test_correction_kernels.py"
TRITON_OPS = "tests/kernels/test_triton_ops.py"
CPP_OPS = "tests/kernels/test_cpp_ops.py"
OPTIMIZER = "tests/optimizer/test_optimizer.py"
FAMILY = "tests/optimizer/test_family.py"
SCHEDULES = "tests/optimizer/test_schedules.py"
CAPTURABLE = "tests/optimizer/test_capturable.py"
MIXED_PRECISION = "tests/optimizer/test_mixed_precision.py"
ROBUSTNESS = "tests/optimizer/test_robustness.py"

# The C++ mutations are grouped by file: the build recompiles only what changed since the last one.
MUTATIONS: tuple[Mutation, ...] = (
    # ------------------------------------------------------------------ the allocation (frontend, shared by backends)
    Mutation(
        "py-gear-ema-weights",
        "GEAR-SAM's EMA weighs the old score by 1 - beta and the new energy by beta",
        "gearsam_fused/allocation.py",
        "(ema * beta).add_(energy, alpha=1.0 - beta)",
        "(ema * (1.0 - beta)).add_(energy, alpha=beta)",
        (SAM_KERNELS, OPTIMIZER),
    ),
    Mutation(
        "py-gear-radius-l1",
        "GEAR-SAM's r_b = rho * s_b / ||s|| with the L1 norm of s instead of the L2 norm",
        "gearsam_fused/allocation.py",
        "return _safe_ratio(t, torch.linalg.vector_norm(t))",
        "return _safe_ratio(t, t.sum())",
        (SAM_KERNELS, OPTIMIZER),
    ),
    Mutation(
        "py-gear-scale-no-sqrt",
        "GEAR-SAM's scale divides the radius by the block energy e_b, not by its norm sqrt(e_b)",
        "gearsam_fused/allocation.py",
        "radius / (energy.sqrt() + delta)",
        "radius / (energy + delta)",
        (SAM_KERNELS, OPTIMIZER),
    ),
    Mutation(
        "py-sam-scale-no-sqrt",
        "SAM's scale rho / (||g||^2 + delta) instead of rho / (||g|| + delta)",
        "gearsam_fused/allocation.py",
        "rho / (norm + delta)",
        "rho / (total + delta)",
        (SAM_KERNELS, OPTIMIZER),
    ),
    # ------------------------------------------------------------------ the reference backend (the oracle)
    Mutation(
        "ref-backup-aliased",
        "the reference backend's backup is the parameter itself, not a copy: restore puts back w + eps",
        "gearsam_fused/backends/reference.py",
        "self._saved.append((p, p.detach().clone()))",
        "self._saved.append((p, p.detach()))",
        (OPTIMIZER,),
    ),
    Mutation(
        "ref-asam-T-not-squared",
        "the reference backend's ASAM perturbation scales g by T = |w| + eta instead of T**2",
        "gearsam_fused/backends/reference.py",
        "direction = (w.abs() + eta).square() * direction",
        "direction = (w.abs() + eta) * direction",
        (SAM_KERNELS, OPTIMIZER),
    ),
    # ------------------------------------------------------------------ the torch backend
    Mutation(
        "torch-energy-not-squared",
        "the torch backend sums the tiles' norms into the block energy instead of their squares",
        "gearsam_fused/backends/torch_backend.py",
        'torch.segment_reduce(partials.square_(), "sum"',
        'torch.segment_reduce(partials, "sum"',
        (SAM_KERNELS,),
    ),
    Mutation(
        "torch-perturb-sign",
        "the torch backend perturbs to w - scale * g",
        "gearsam_fused/backends/torch_backend.py",
        "torch.where(skipped, w, w.addcmul(g, tile_scale), out=w)",
        "torch.where(skipped, w, w.addcmul(g, tile_scale, value=-1), out=w)",
        (SAM_KERNELS,),
    ),
    Mutation(
        "torch-sgd-dampening",
        "the torch backend's SGD dampens the momentum buffer instead of the gradient",
        "gearsam_fused/backends/torch_backend.py",
        'buf.mul_(h["momentum"]).add_(g, alpha=1 - h["dampening"])',
        'buf.mul_(h["momentum"] * (1 - h["dampening"])).add_(g)',
        (BASE_STEP,),
    ),
    Mutation(
        "torch-adam-no-bias-correction",
        "the torch backend's Adam drops the second moment's bias correction",
        "gearsam_fused/backends/torch_backend.py",
        'torch.sqrt(second, out=scratch).div_(bias_correction2_sqrt).add_(h["eps"])',
        'torch.sqrt(second, out=scratch).add_(h["eps"])',
        (BASE_STEP,),
    ),
    # ------------------------------------------------------------------ the Triton kernels
    Mutation(
        "triton-energy-first-tile",
        "the Triton block sum leaves out each block's first tile",
        "triton_kernels/energy.py",
        "for start in range(first, last, CHUNK):",
        "for start in range(first + 1, last, CHUNK):",
        (SAM_KERNELS,),
    ),
    Mutation(
        "triton-perturb-asam-T",
        "the Triton perturbation scales g by T = |w| + eta instead of T**2 (ASAM)",
        "triton_kernels/perturb.py",
        "direction = t * t * direction",
        "direction = t * direction",
        (SAM_KERNELS,),
    ),
    Mutation(
        "triton-restore-last-tile",
        "the Triton restore leaves the bucket's last tile at w + eps",
        "triton_kernels/perturb.py",
        "n_tiles = param.numel() // tile\n",
        "n_tiles = param.numel() // tile - 1\n",
        (SAM_KERNELS,),
    ),
    Mutation(
        "triton-gear-ema-nonfinite",
        "the Triton GEAR allocation lets a non-finite block energy into the EMA",
        "triton_kernels/allocation.py",
        "return e, tl.where(e - e == 0, beta * s + (1.0 - beta) * e, s)",
        "return e, beta * s + (1.0 - beta) * e",
        (SAM_KERNELS, ROBUSTNESS),
    ),
    Mutation(
        "triton-sgd-nesterov",
        "the Triton SGD's Nesterov step takes fma(momentum, g, buf) instead of fma(momentum, buf, g)",
        "triton_kernels/base_step.py",
        "g = tl.fma(momentum, buf, g)",
        "g = tl.fma(momentum, g, buf)",
        (BASE_STEP,),
    ),
    Mutation(
        "triton-adam-eps-dropped",
        "the Triton Adam leaves eps out of the denominator",
        "triton_kernels/base_step.py",
        "denom = denom + host_scalar(eps32, eps64, COMPUTE)",
        "denom = denom",
        (BASE_STEP,),
    ),
    Mutation(
        "triton-correction-sign",
        "the Triton base step subtracts LookSAM's correction (and the mix's kept term) instead of adding it",
        "triton_kernels/base_step.py",
        "g = tl.fma(tl.load(cscale_ptr + block).to(COMPUTE), tl.load(corr_ptr + offsets), g)",
        "g = tl.fma(-tl.load(cscale_ptr + block).to(COMPUTE), tl.load(corr_ptr + offsets), g)",
        (CORRECTION, SCHEDULES),
    ),
    Mutation(
        "triton-fsam-lerp",
        "the Triton F-SAM EMA moves away from the gradient: lerp(m, g, w) with g - m negated",
        "triton_kernels/mix.py",
        "m_new = tl.fma(w, g - m, m)",
        "m_new = tl.fma(w, m - g, m)",
        (CORRECTION, FAMILY),
    ),
    Mutation(
        "triton-found-inf-keeps-perturbed",
        "the Triton Adam step skipped for an overflow (found_inf) leaves w + eps instead of restoring w",
        "triton_kernels/base_step.py",
        "see _sgd_tile\n        if tl.load(found_inf_ptr) != 0.0:\n            if HAS_BACKUP:\n"
        "                tl.store(param_ptr + offsets, tl.load(backup_ptr + offsets))",
        "see _sgd_tile\n        if tl.load(found_inf_ptr) != 0.0:\n            if HAS_BACKUP:\n"
        "                tl.store(param_ptr + offsets, tl.load(param_ptr + offsets))",
        (TRITON_OPS,),
    ),
    # ------------------------------------------------------------------ the C++ CPU kernels
    Mutation(
        "cpp-energy-last-tile",
        "the C++ block sum leaves out each block's last tile",
        "csrc/cpu/energy.cpp",
        "for (int64_t t = range[b]; t < range[b + 1]; ++t)",
        "for (int64_t t = range[b]; t + 1 < range[b + 1]; ++t)",
        (SAM_KERNELS,),
    ),
    Mutation(
        "cpp-fsam-ascent-sign",
        "the C++ F-SAM ascent direction is g + sigma * m instead of g - sigma * m",
        "csrc/cpu/friendly.h",
        "std::fma(-s, mi, gi)",
        "std::fma(s, mi, gi)",
        (CORRECTION, FAMILY),
    ),
    Mutation(
        "cpp-perturb-sign",
        "the C++ perturbation writes w - scale * g",
        "csrc/cpu/perturb.cpp",
        "out[i] = static_cast<scalar_t>(x + direction * s);",
        "out[i] = static_cast<scalar_t>(x - direction * s);",
        (SAM_KERNELS,),
    ),
    Mutation(
        "cpp-sam-scale-block-norm",
        "the C++ SAM allocation divides rho by the block's norm instead of the global norm",
        "csrc/cpu/allocation.cpp",
        "out_scale[b] = finite ? rho / (norm + delta) : 0.0;",
        "out_scale[b] = finite ? rho / (root + delta) : 0.0;",
        (SAM_KERNELS, OPTIMIZER),
    ),
    Mutation(
        "cpp-sgd-momentum-dropped",
        "the C++ SGD adds the dampened gradient to the momentum buffer without multiplying the buffer by momentum",
        "csrc/cpu/base_step.cpp",
        "b = std::fma(c.one_minus_dampening, g, buf[i] * c.momentum);",
        "b = std::fma(c.one_minus_dampening, g, buf[i]);",
        (BASE_STEP,),
    ),
    Mutation(
        "cpp-adam-no-bias-correction",
        "the C++ Adam drops the second moment's bias correction",
        "csrc/cpu/base_step.cpp",
        "std::sqrt(second[i]) / c.bias_correction2_sqrt + c.eps",
        "std::sqrt(second[i]) + c.eps",
        (BASE_STEP,),
    ),
    Mutation(
        "cpp-wsam-sharpness-sign",
        "the C++ WSAM sharpness step (decoupled) takes g - h instead of h - g",
        "csrc/cpu/base_step.cpp",
        "std::fma(g.sharpness_step, g.grad[i] - g.correction[i], w_new)",
        "std::fma(g.sharpness_step, g.correction[i] - g.grad[i], w_new)",
        (CORRECTION, FAMILY),
    ),
    Mutation(
        "cpp-found-inf-no-restore",
        "the C++ base step skipped for an overflow (found_inf) leaves w + eps instead of restoring w",
        "csrc/cpu/base_step.cpp",
        "if (!backup.is_same(param)) restore(param, backup);",
        "if (false) restore(param, backup);",
        (CPP_OPS, CAPTURABLE),
    ),
    # ------------------------------------------------------------------ the frontend
    Mutation(
        "py-adamw-decay",
        "AdamW's decay factor 1 - weight_decay instead of 1 - lr * weight_decay (torch backend, Triton launcher)",
        "gearsam_fused/base_step.py",
        "return lr / (1 - beta1**k), (1 - beta2**k) ** 0.5, 1 - lr * weight_decay",
        "return lr / (1 - beta1**k), (1 - beta2**k) ** 0.5, 1 - weight_decay",
        (BASE_STEP,),
    ),
    Mutation(
        "py-looksam-coefficient",
        "LookSAM's projection <g, g_s> / ||g|| instead of <g, g_s> / ||g||^2",
        "gearsam_fused/optim.py",
        "coefficient = torch.where(positive, dot / torch.where(positive, energy, 1.0), 0.0)",
        "coefficient = torch.where(positive, dot / torch.where(positive, energy, 1.0).sqrt(), 0.0)",
        (SCHEDULES,),
    ),
    Mutation(
        "py-skipped-step-no-ema",
        "a step the schedule skips leaves GEAR-SAM's EMA out",
        "gearsam_fused/optim.py",
        "if self.rule == GEAR_RULE:\n            self._backend.allocate(",
        "if self.rule == SAM_RULE:\n            self._backend.allocate(",
        (SCHEDULES,),
    ),
    Mutation(
        "py-fsam-never-started",
        "F-SAM's EMA never counts as started: every step takes m = g and ascends along g",
        "gearsam_fused/optim.py",
        "tuple(s or p.grad is not None for s, p in zip(started, params, strict=True))",
        "tuple(s and p.grad is not None for s, p in zip(started, params, strict=True))",
        (FAMILY,),
    ),
    Mutation(
        "py-found-inf-ema-kept",
        "a step the device skips for an overflow keeps the EMA the skipped allocation wrote",
        "gearsam_fused/optim.py",
        "self._device.keep_ema(self._run.ema, skip)",
        "self._device.keep_ema(self._run.ema, skip * 0)",
        (CAPTURABLE,),
    ),
    Mutation(
        "py-amp-second-overflow-steps",
        "SAMScaler takes the step when only the second pass overflowed, instead of cancelling it",
        "gearsam_fused/amp.py",
        "if second_ran and second_finite:",
        "if second_ran:",
        (MIXED_PRECISION,),
    ),
    Mutation(
        "py-gsam-sign",
        "GSAM's descent h + alpha * (g - c h) instead of h - alpha * (g - c h): the surrogate gap's sign",
        "gearsam_fused/family.py",
        "return Mix(1.0 + self.alpha * c, torch.full_like(c, -self.alpha))",
        "return Mix(1.0 - self.alpha * c, torch.full_like(c, self.alpha))",
        (FAMILY,),
    ),
    Mutation(
        "py-wsam-decoupled-sign",
        "WSAM's decoupled sharpness step w + lr * a * (h - g) instead of w - lr * a * (h - g) (unfused backends)",
        "gearsam_fused/family.py",
        'backend.add_kept_([-group["lr"] * self.weight for group in param_groups])',
        'backend.add_kept_([group["lr"] * self.weight for group in param_groups])',
        (FAMILY,),
    ),
)


@dataclass
class PytestRun:
    code: int | None  # None: stopped at the timeout
    failure: str  # the first failing test's node id ("" when none)
    seconds: float
    tail: str


@dataclass
class Outcome:
    mutation: Mutation
    verdict: str
    stage: str = ""  # which run caught it: targets, tests (the whole folder) or full
    test: str = ""
    seconds: float = 0.0
    note: str = ""


# ---------------------------------------------------------------------------------------------- checks
def check_mutations(root: Path, mutations: tuple[Mutation, ...] = MUTATIONS) -> None:
    """Fail loudly unless every id is unique, every ``old`` occurs exactly once in its file and every target
    exists: a mutation that silently applied nowhere (or twice) would report nothing true."""
    problems = []
    ids = [m.id for m in mutations]
    problems += [f"{i}: id used twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    for m in mutations:
        path = root / m.file
        count = path.read_text().count(m.old) if path.is_file() else -1
        if count != 1:
            problems.append(f"{m.id}: `old` occurs {count} times in {m.file}" if count >= 0 else f"{m.id}: no {m.file}")
        if m.old == m.new:
            problems.append(f"{m.id}: `new` is `old`")
        problems += [f"{m.id}: no target {t}" for t in m.targets if not (root / t).exists()]
    if problems:
        raise SystemExit("mutation list is wrong:\n  " + "\n  ".join(problems))


def changes_extension(m: Mutation) -> bool:
    return m.file.startswith("csrc/")


# ---------------------------------------------------------------------------------------------- the copy
class Workspace:
    """A copy of the working tree in a temporary folder: the files git lists (tracked, and untracked but not
    ignored), the built extension, and the link the installed package has from ``gearsam_fused/triton_kernels`` to
    ``triton_kernels/``. Mutations are applied to it one at a time and undone after each."""

    def __init__(self, root: Path):
        self.top = Path(tempfile.mkdtemp(prefix="gearsam-mutations-"))
        self.tree = self.top / "tree"
        self.saved_extension = self.top / "extension.so"
        self._copy(root)
        self.env = self._environment()

    def _copy(self, root: Path) -> None:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                                capture_output=True, text=True).stdout  # fmt: skip
        extensions = [p.relative_to(root).as_posix() for p in root.glob(EXTENSION_GLOB)]
        if not extensions:
            raise SystemExit(f"no built extension ({EXTENSION_GLOB}) in {root}: build it first")
        for name in [n for n in listed.split("\0") if n] + extensions:
            source = root / name
            if source.is_file() or source.is_symlink():  # a file deleted but still in the index is not copied
                (self.tree / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, self.tree / name, follow_symlinks=False)
        self.extension = self.tree / extensions[0]
        shutil.copy2(self.extension, self.saved_extension)
        # without the link, gearsam_fused.triton_kernels would come from the installed checkout, not from the copy
        (self.tree / "gearsam_fused" / "triton_kernels").symlink_to(Path("..") / "triton_kernels")

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "GEARSAM_TESTS"}  # the tier is chosen by --full alone
        # PYTHONPATH: the tests' subprocesses import the copy too. No bytecode: a mutation undone within the second
        # it was made, to the same size, would otherwise be read back from its stale .pyc.
        env.update(PYTHONPATH=str(self.tree), PYTHONDONTWRITEBYTECODE="1")
        return env

    def check_imports(self) -> list[str]:
        """Where a fresh interpreter with the copy's environment imports the package, its Triton kernels and its
        extension from; a SystemExit unless all three lie in the copy."""
        code = (
            "import gearsam_fused, gearsam_fused.triton_kernels as t\n"
            "from gearsam_fused.backends.cpp_backend import cpp_installed\n"
            "assert cpp_installed()\n"
            "from gearsam_fused import _C\n"
            "print(gearsam_fused.__file__, t.__file__, _C.__file__, sep='\\n')\n"
        )
        result = subprocess.run([sys.executable, "-c", code], cwd=self.top, env=self.env, capture_output=True,
                                text=True)  # fmt: skip
        paths = result.stdout.split()
        inside = [Path(p).resolve().is_relative_to(self.tree.resolve()) for p in paths]
        if result.returncode != 0 or len(paths) != 3 or not all(inside):
            raise SystemExit(f"the copy's package is not what gets imported:\n{result.stdout}{result.stderr}")
        return paths

    def apply(self, m: Mutation) -> str:
        """Apply ``m``; returns the file's original text, for :meth:`undo`."""
        path = self.tree / m.file
        text = path.read_text()
        if text.count(m.old) != 1:
            raise SystemExit(f"{m.id}: `old` no longer occurs exactly once in the copy's {m.file}")
        path.write_text(text.replace(m.old, m.new))
        return text

    def undo(self, m: Mutation, text: str) -> None:
        # written anew, so its time is newer than the objects built from the mutation: ninja rebuilds them next time
        (self.tree / m.file).write_text(text)
        if changes_extension(m):
            shutil.copy2(self.saved_extension, self.extension)

    def build(self) -> tuple[bool, float, str]:
        """Rebuild the extension in the copy (ninja recompiles what changed); ``(built, seconds, log tail)``. A build
        that leaves the original extension's bytes counts as failed: the mutation changed nothing compiled."""
        env = {**self.env, "GEARSAM_BUILD_CPP": "1", "GEARSAM_BUILD_CUDA": "0"}
        command = [sys.executable, "setup.py", "build_ext", "--inplace", "--force"]
        start = time.monotonic()
        try:
            result = subprocess.run(command, cwd=self.tree, env=env, capture_output=True, text=True,
                                    timeout=BUILD_TIMEOUT)  # fmt: skip
        except subprocess.TimeoutExpired:
            return False, time.monotonic() - start, f"the build ran past {BUILD_TIMEOUT} s"
        seconds = time.monotonic() - start
        log = (result.stdout + result.stderr)[-3000:]
        if result.returncode != 0:
            return False, seconds, log
        if _digest(self.extension) == _digest(self.saved_extension):
            return False, seconds, "the build left the extension as it was"
        return True, seconds, log

    def pytest(self, paths: list[str], full: bool = False, first_failure: bool = True) -> PytestRun:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += (["-x"] if first_failure else []) + (["--full"] if full else []) + paths
        return _run_pytest(command, self.tree, self.env)

    def remove(self) -> None:
        shutil.rmtree(self.top, ignore_errors=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run_pytest(command: list[str], cwd: Path, env: dict[str, str]) -> PytestRun:
    """Run pytest in a process group of its own, so that a timeout also stops the processes its tests started."""
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=PYTEST_TIMEOUT)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        code = None
    return PytestRun(code, _first_failure(output), time.monotonic() - start, output[-4000:])


def _first_failure(output: str) -> str:
    """The node id of the first FAILED or ERROR line of pytest's short summary ("" when there is none)."""
    for line in output.splitlines():
        match = re.match(r"(?:FAILED|ERROR) (.+?)(?: - .*)?$", line)
        if match:
            return match.group(1)
    return ""


# ---------------------------------------------------------------------------------------------- one mutation
def judge(space: Workspace, m: Mutation) -> Outcome:
    """Apply ``m``, run the tiers on it as the module docstring says, undo it; then check the catching test."""
    start = time.monotonic()
    text = space.apply(m)
    try:
        outcome = _judge_applied(space, m)
    finally:
        space.undo(m, text)
    if outcome.test:
        outcome = _control(space, outcome)
    outcome.seconds = time.monotonic() - start
    return outcome


def _judge_applied(space: Workspace, m: Mutation) -> Outcome:
    note = ""
    if changes_extension(m):
        built, seconds, log = space.build()
        if not built:
            return Outcome(m, "does not compile", note=_last_line(log))
        note = f"build {seconds:.0f} s"
    runs = [("targets", list(m.targets), False), ("tests", test_folders(m), False), ("full", list(m.targets), True)]
    for stage, paths, full in runs:
        run = space.pytest(paths, full)
        if run.code == 1:
            verdict = "only full catches" if full else "default catches"
            return Outcome(m, verdict, stage, run.failure, note=note)
        if run.code != 0:
            why = "timed out" if run.code is None else f"pytest exit code {run.code}"
            return Outcome(m, f"error: {why} ({stage})", stage, note=_join(note, _last_line(run.tail)))
    return Outcome(m, "neither catches", note=note)


def test_folders(m: Mutation, root: Path = ROOT) -> list[str]:
    """The whole ``tests`` folder as its subfolders, those of ``m``'s targets first, then by :data:`FOLDER_ORDER`:
    pytest runs its arguments in order, so a mutation that a test near its targets catches ends the run early. Each test function has the same
    cases, and so the same default-tier selection, however the folder is named on the command line."""
    folders = [p.relative_to(root).as_posix() for p in (root / "tests").iterdir() if any(p.glob("test_*.py"))]
    folders.sort(key=lambda f: (FOLDER_ORDER.index(f) if f in FOLDER_ORDER else len(FOLDER_ORDER), f))
    near = [f for t in m.targets for f in folders if t == f or t.startswith(f + "/")]
    return list(dict.fromkeys(near + folders))


def _control(space: Workspace, outcome: Outcome) -> Outcome:
    """Run the catching test alone on the unmutated copy (``--full``, so that it runs whatever the default tier
    selects); it must pass, or it caught nothing. For "only full catches", also say whether the default tier
    selects that case at all."""
    run = space.pytest([outcome.test], full=True)
    if run.code != 0:
        outcome.verdict = "error: the catching test fails without the mutation"
        outcome.note = _join(outcome.note, _last_line(run.tail))
    elif outcome.verdict == "only full catches":
        selected = _selected_by_default(space, outcome.test)
        outcome.note = _join(outcome.note, "the default tier selects it" if selected else "not in the default tier")
    return outcome


def _selected_by_default(space: Workspace, node: str) -> bool:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", node]
    result = subprocess.run(command, cwd=space.tree, env=space.env, capture_output=True, text=True)
    return any(line.strip() == node for line in result.stdout.splitlines())


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


# ---------------------------------------------------------------------------------------------- the report
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}"


def commit(root: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short=12", "HEAD") + (" with uncommitted changes" if dirty else "")


def _now() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def _row(o: Outcome, when: str) -> str:
    test = f"`{o.test}`" if o.test else ""
    cells = [o.mutation.id, f"`{o.mutation.file}`", o.verdict, test, o.stage, f"{o.seconds:.0f}", when, o.note]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split(" | ")]


def carried_rows(path: Path, repeated: set[str]) -> dict[str, str]:
    """The rows of the report at ``path`` of the mutations of the list that this run does not repeat, by id: a run
    of some mutations (``--only``) updates their rows and keeps the others, each with the date of its own run."""
    if not path.is_file():
        return {}
    known = {m.id for m in MUTATIONS} - repeated
    rows = (line for line in path.read_text().splitlines() if line.startswith("| "))
    return {_cells(row)[0]: row for row in rows if _cells(row)[0] in known}


def report(outcomes: list[Outcome], carried: dict[str, str], argv: list[str], seconds: float) -> str:
    """The report of this run's ``outcomes`` (in the list's order, with the ``carried`` rows of earlier runs)."""
    new = {o.mutation.id: _row(o, _now()) for o in outcomes}
    rows = [new.get(m.id) or carried[m.id] for m in MUTATIONS if m.id in new or m.id in carried]
    counts: dict[str, int] = {}
    for row in rows:
        verdict = _cells(row)[2].split(":")[0]
        counts[verdict] = counts.get(verdict, 0) + 1
    lines = [
        "# Mutation check of the default tier",
        "",
        "Written by `python tests/quality/mutations.py` (see its docstring): each mutation is applied to a copy of the",
        "working tree, the default tier runs on its targets, then on all of `tests`, then the full tier on the",
        'targets, until one fails. "only full catches" marks a gap in the default tier\'s selection.',
        "",
        f"- machine: {machine()}",
        f"- last run: {_now()}, commit {commit(ROOT)}, {len(outcomes)} mutations in {seconds / 60:.0f} min: "
        f"`python tests/quality/mutations.py{''.join(' ' + a for a in argv)}`"
        + (f"; {len(rows) - len(outcomes)} rows kept from earlier runs" if len(rows) > len(outcomes) else ""),
        f"- verdicts: {', '.join(f'{n} {k}' for k, n in counts.items())}",
        "",
        "| id | file | verdict | caught by | run | seconds | date | note |",
        "|---|---|---|---|---|---:|---|---|",
        *rows,
        "",
        "## The mutations",
        "",
    ]
    for m in MUTATIONS:
        if m.id in new or m.id in carried:
            targets = ", ".join(f"`{t}`" for t in m.targets)
            lines.append(f"- **{m.id}** (`{m.file}`): {m.description}. Targets: {targets}.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- main
def select(only: str | None) -> tuple[Mutation, ...]:
    if not only:
        return MUTATIONS
    wanted = [i.strip() for i in only.split(",") if i.strip()]
    known = {m.id for m in MUTATIONS}
    unknown = [i for i in wanted if i not in known]
    if unknown:
        raise SystemExit(f"unknown mutation ids: {', '.join(unknown)} (--list shows them)")
    return tuple(m for m in MUTATIONS if m.id in wanted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", metavar="ID[,ID]", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--keep", action="store_true", help="keep the copy of the working tree")
    args = parser.parse_args(argv)
    check_mutations(ROOT)
    chosen = select(args.only)
    if args.list:
        for m in chosen:
            print(f"{m.id:34} {m.file:38} {m.description}")
        return 0
    run(chosen, args.keep, sys.argv[1:] if argv is None else argv)
    return 0


def run(chosen: tuple[Mutation, ...], keep: bool, argv: list[str]) -> None:
    """Judge each mutation in one copy of the tree, rewriting the report after each (an interrupted run keeps what
    it found), then print it."""
    start = time.monotonic()
    carried = carried_rows(REPORT, {m.id for m in chosen})
    space = Workspace(ROOT)
    print(f"copy: {space.tree}")
    outcomes: list[Outcome] = []
    try:
        print("imports from:", *space.check_imports(), sep="\n  ")
        for m in chosen:
            o = judge(space, m)
            outcomes.append(o)
            print(f"{m.id:34} {o.verdict:20} {o.seconds:6.0f} s  {o.test} {o.note}", flush=True)
            REPORT.write_text(report(outcomes, carried, argv, time.monotonic() - start))
    finally:
        if keep:
            print(f"kept: {space.tree}")
        else:
            space.remove()
    print(REPORT.read_text() if REPORT.is_file() else "no mutation was judged")


if __name__ == "__main__":
    sys.exit(main())
