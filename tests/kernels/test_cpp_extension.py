"""The compiled extension (``gearsam_fused._C``, sources in ``csrc/``): that it is built, that its CPU results do not
depend on the number of threads, that a missing build says how to build it, what its operators do with tensors they
have no kernel for, and that every CUDA source compiles for Hopper. The operators' schemas and fakes are tested in
test_cpp_ops.py; their parity with the reference backend runs with the other backends in test_sam_kernels.py and
test_engine.py."""

import ast
import copy
import functools
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.backends import cpp_backend, resolve_backend_name
from gearsam_fused.backends.cpp_backend import cpp_built_with_cuda, cpp_installed
from gearsam_fused.machine import cpu_caches

from conftest import SGD_KW, correctly_rounded_sqrt, flat, stream_threshold_elements

CSRC = Path(__file__).resolve().parents[2] / "csrc"
needs_cpp = pytest.mark.skipif(not cpp_installed(), reason="the C++ extension is not built")


def test_extension_is_built_wherever_a_compiler_is():
    """The other cpp tests skip without the extension; this one makes sure that never hides a failed build."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) on this machine")
    assert cpp_installed(), f"a C++ compiler is here but gearsam_fused._C is missing: {cpp_backend._load()[1]}"


# ------------------------------------------------------------------------------------------- the C++ runtime
#: a sample of libstdc++'s locale and stream classes, mangled: std::locale, basic_istream<char>, basic_ostream<char>,
#: ios_base
_CPP_RUNTIME = re.compile(r"^_ZNK?(St6locale|Si|So|St8ios_base)")
needs_elf_tools = pytest.mark.skipif(
    os.uname().sysname != "Linux" or shutil.which("nm") is None, reason="reads ELF symbols with nm (Linux)"
)


def _exported_runtime_symbols(library: Path) -> list[str]:
    """The C++ runtime symbols ``library`` defines and exports: other libraries' references may bind to them."""
    nm = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    return [line.split()[-1] for line in nm.stdout.splitlines() if _CPP_RUNTIME.match(line.split()[-1])]


def _setup_constant(name: str):
    """A literal assigned at the top level of setup.py (which cannot be imported: importing it builds)."""
    for node in ast.parse((CSRC.parent / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py assigns no {name}")


@needs_cpp
@needs_elf_tools
def test_the_extension_exports_no_cpp_runtime_of_its_own():
    """Either the extension uses the libstdc++.so that torch loads, or the copy a static runtime put into it is
    private. An exported copy binds partly to torch's: built so on a CUDA image, its error messages crashed. Where
    libstdc++ is linked dynamically (most machines) there is no copy, and this guards the others."""
    from gearsam_fused import _C

    assert _exported_runtime_symbols(Path(_C.__file__)) == []


@needs_elf_tools
def test_setups_link_flags_keep_a_static_cpp_runtime_private(tmp_path):
    """A library with a stream, linked with libstdc++ statically as such a compiler does: it exports the runtime's
    symbols, and with setup.py's link flags none."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) on this machine")
    source = tmp_path / "describe.cpp"
    source.write_text("#include <sstream>\n#include <string>\n"
                      "std::string describe(int v) { std::ostringstream s; s << v; return s.str(); }\n")  # fmt: skip

    def build(name: str, flags: list[str]) -> tuple[Path, subprocess.CompletedProcess]:
        library = tmp_path / f"lib{name}.so"
        command = [compiler, "-shared", "-fPIC", "-static-libstdc++", str(source), "-o", str(library), *flags]
        return library, subprocess.run(command, capture_output=True, text=True, timeout=300)

    exported, done = build("exported", [])
    if done.returncode != 0:
        pytest.skip(f"{compiler} cannot link libstdc++ statically: {done.stderr[-500:]}")
    if not _exported_runtime_symbols(exported):
        libcxx = subprocess.run(["nm", "-D", str(exported)], capture_output=True, text=True, check=True).stdout
        if "_ZNSt3__1" in libcxx:
            pytest.skip(f"{compiler}'s C++ runtime is libc++, not libstdc++")
    assert _exported_runtime_symbols(exported) != []
    private, done = build("private", _setup_constant("LINUX_LINK_FLAGS"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert _exported_runtime_symbols(private) == []


# ------------------------------------------------------------------------------------------- threads
#: Thread counts of the determinism checks; more threads than cores is fine for a bitwise comparison.
THREADS = (1, 2, 3, 4)


class WideNet(nn.Module):
    """About 300k parameters in a few large tensors: each block spans many tiles, so threads split the work. Its
    ``"fine"`` partition has three blocks of 9, 129 and 3 tiles of 2048, whose boundaries fall inside the threads'
    shares of the 141 tiles."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh())
        self.head = nn.Linear(512, 10)

    def forward(self, x):
        return self.head(self.body(x))


def _train(model, opt, steps: int, optimizer_threads: int):
    """Forward and backward on one thread (a matrix product's rounding depends on how many threads share it), the
    optimizer's steps on ``optimizer_threads``."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
        for sam_step in (opt.first_step, opt.second_step):
            torch.set_num_threads(1)
            nn.functional.cross_entropy(model(x), y).backward()
            torch.set_num_threads(optimizer_threads)
            sam_step(zero_grad=True)
    return flat(model), opt.block_stats()


BASES = {"sgd": (torch.optim.SGD, SGD_KW), "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01))}


@needs_cpp
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("base", list(BASES))
def test_any_number_of_threads_gives_bitwise_identical_runs(cls, adaptive, base):
    """30 steps in three blocks, with the base step fused, on 1, 2, 3 and 4 threads."""
    torch.manual_seed(0)
    start = WideNet()
    base_cls, kw = BASES[base]
    runs = []
    previous = torch.get_num_threads()
    try:
        for threads in THREADS:
            model = copy.deepcopy(start)
            opt = cls(model, base_cls, rho=0.05, adaptive=adaptive, eta=0.01, partition="fine", backend="cpp", **kw)
            runs.append(_train(model, opt, steps=30, optimizer_threads=threads))
            assert opt.base_step_mode == "fused", opt.base_step_reason
    finally:
        torch.set_num_threads(previous)
    assert [b.tile_count_of_block.tolist() for b in opt.backend.layout.buckets] == [[9, 129, 3]]
    weights, stats = runs[0]
    assert (stats["share"] > 1e-3).all()  # every block is perturbed
    for threads, (other_weights, other_stats) in zip(THREADS[1:], runs[1:]):
        assert torch.equal(other_weights, weights), threads
        assert all(torch.equal(other_stats[k], stats[k]) for k in stats), threads


@needs_cpp
def test_any_number_of_threads_gives_bitwise_identical_kernels():
    """The launchers themselves, on a bucket of 64 tiles in 3 uneven blocks, in every floating dtype, on 1, 2, 3
    and 4 threads: energy, allocation, perturbation, and (float32, float64) the fused SGD and Adam steps."""
    kernels = torch.ops.gearsam_fused

    tile, tile_count_of_block = 2048, torch.tensor([1, 40, 23])
    first_tile_of_block = torch.cat([torch.zeros(1, dtype=torch.int64), tile_count_of_block.cumsum(0)])
    block_of_tile = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), tile_count_of_block)
    g = torch.Generator().manual_seed(0)
    base_w, base_g = torch.randn(64 * tile, generator=g), torch.randn(64 * tile, generator=g)
    ema = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    adam_kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, amsgrad=True, maximize=False,
                lr=1e-3, step=3)  # fmt: skip
    previous = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            results = []
            for threads in THREADS:
                torch.set_num_threads(threads)
                w, grad = base_w.to(dtype, copy=True), base_g.to(dtype, copy=True)
                partials = torch.empty(64, dtype=torch.float64)
                energy = kernels.block_energy(
                    grad, w, first_tile_of_block, partials, tile=tile, adaptive=True, eta=0.01
                )
                smoothed = ema.clone()
                scale, radius = kernels.allocate(energy, smoothed, gear=True, rho=0.05, beta=0.9, delta=1e-12)
                backup = torch.empty_like(w)
                kernels.perturb_(w, grad, backup, scale, block_of_tile, tile=tile, adaptive=True, eta=0.01)
                results.append([energy, partials, smoothed, scale, radius, backup, w])
                if dtype in (torch.float32, torch.float64):  # the base step's dtypes
                    sgd, buf = w.clone(), (base_g * 0.5).to(dtype)
                    kernels.sgd_step_(sgd, grad, backup, buf, tile=tile, lr=0.1, weight_decay=5e-4, momentum=0.9,
                                      dampening=0.0, nesterov=True, maximize=False, first=False)  # fmt: skip
                    moments = [(base_g * c).abs().to(dtype) for c in (0.1, 0.01, 0.02)]
                    adam = w.clone()
                    kernels.adam_step_(adam, grad, backup, *moments, tile=tile, **adam_kw)
                    results[-1] += [sgd, buf, adam, *moments]
            for threads, other in zip(THREADS[1:], results[1:]):
                for a, b in zip(results[0], other):
                    assert torch.equal(a, b), (dtype, threads)
    finally:
        torch.set_num_threads(previous)


@needs_cpp
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="non-temporal stores are the x86-64 kernels' only")
@pytest.mark.skipif("GEARSAM_STREAM_THRESHOLD_BYTES" in os.environ, reason="the threshold is set from outside")
def test_the_stream_threshold_is_a_cores_private_cache_from_sysfs():
    """The CPU kernels stream their outputs past the stream threshold, a core's private (level-2) cache, read from
    sysfs with C stdio (1 MiB where sysfs gives none): the same size as read here."""
    from gearsam_fused import _C

    expected = cpu_caches().get(2)  # read by Python, apart from the kernels' reading of the same files
    assert _C.cpu_stream_threshold_bytes() == (1 << 20 if expected is None else expected)


THRESHOLD_VALUES = ["12345", "0", "5k", "-1", ""]


@functools.cache
def threshold_processes() -> dict[str, subprocess.CompletedProcess]:
    """A process for each of ``THRESHOLD_VALUES`` (the threshold is read once a process), all started at once:
    the cases below read their own."""
    code = "import torch, gearsam_fused\nfrom gearsam_fused import _C\nprint(_C.cpu_stream_threshold_bytes())\n"
    started = {
        value: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "GEARSAM_STREAM_THRESHOLD_BYTES": value})
        for value in THRESHOLD_VALUES
    }  # fmt: skip
    done = {}
    for value, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        done[value] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


@needs_cpp
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="non-temporal stores are the x86-64 kernels' only")
@pytest.mark.parametrize("value", THRESHOLD_VALUES)
def test_the_environment_sets_the_stream_threshold_or_is_refused_by_name(value):
    """``GEARSAM_STREAM_THRESHOLD_BYTES`` replaces the threshold read from sysfs (0: every output streams); anything
    but a whole number of bytes is an error that names the variable and the value, at the first kernel that asks."""
    done = threshold_processes()[value]
    if value in ("12345", "0"):
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == value
    else:
        assert done.returncode != 0
        message = f"GEARSAM_STREAM_THRESHOLD_BYTES must be a whole number of bytes, 0 or more, not '{value}'"
        assert message in done.stderr


@needs_cpp
def test_buffers_past_the_stream_threshold_stream_their_outputs_to_the_same_bits():
    """Outputs the CPU kernels write without reading (backup, restored and updated parameter) go out with
    non-temporal stores past ``cpu_stream_threshold_bytes()``: the same bits as torch, on a bucket just past it (float32
    on 1 and 2 threads, float64), with a length that is no multiple of the kernels' runs; the perturbation's kept
    gradient too. Adam against torch's with the
    correctly rounded root the kernel takes (conftest.correctly_rounded_sqrt)."""
    kernels = torch.ops.gearsam_fused
    tile = 1024
    previous = torch.get_num_threads()
    try:
        for dtype, threads in ((torch.float32, 1), (torch.float32, 2), (torch.float64, 2)):
            n = (stream_threshold_elements(dtype) // tile + 3) * tile  # just past the threshold
            g = torch.Generator().manual_seed(0)
            w0, grad = torch.randn(n, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)
            torch.set_num_threads(threads)
            w, backup = w0.clone(), torch.empty_like(w0)
            scale = torch.tensor([0.01], dtype=torch.float64)
            kernels.perturb_(w, grad, backup, scale, torch.zeros(n // tile, dtype=torch.int32), tile=tile,
                             adaptive=False, eta=0.0)  # fmt: skip
            assert torch.equal(backup, w0)
            assert torch.equal(w, w0 + grad * torch.tensor(0.01, dtype=dtype))
            kernels.restore_(w, backup, tile=tile)
            assert torch.equal(w, w0)
            kernels.perturb_(w, grad, backup, scale, torch.zeros(n // tile, dtype=torch.int32), tile=tile,
                             adaptive=True, eta=0.01)  # fmt: skip
            T = w0.abs() + torch.tensor(0.01, dtype=dtype)
            assert torch.equal(backup, w0) and torch.equal(w, w0 + (T * T * grad) * torch.tensor(0.01, dtype=dtype))
            # the SAM family's first gradient kept in the same pass, streamed too; one block skipped (scale 0)
            kernels.restore_(w, backup, tile=tile)
            kept, scales = torch.full_like(w0, float("nan")), torch.tensor([0.01, 0.0], dtype=torch.float64)
            block_of_tile = (torch.arange(n // tile) % 2).to(torch.int32)
            kernels.perturb_(w, grad, backup, scales, block_of_tile, tile=tile, adaptive=False, eta=0.0, kept=kept)
            moved = (block_of_tile == 0).repeat_interleave(tile)
            assert torch.equal(kept, grad) and torch.equal(backup, w0)
            assert torch.equal(w, torch.where(moved, w0 + grad * torch.tensor(0.01, dtype=dtype), w0))

            p = torch.nn.Parameter(w0.clone())
            p.grad = grad.clone()
            sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=5e-4, foreach=False)
            sgd.state[p] = {"momentum_buffer": grad * 0.5}
            sgd.step()
            out, buf = torch.full_like(w0, float("nan")), grad * 0.5
            kernels.sgd_step_(out, grad, w0.clone(), buf, tile=tile, lr=0.1, weight_decay=5e-4, momentum=0.9,
                              dampening=0.0, nesterov=False, maximize=False, first=False)  # fmt: skip
            assert torch.equal(out, p.detach()) and torch.equal(buf, sgd.state[p]["momentum_buffer"])

            p = torch.nn.Parameter(w0.clone())
            p.grad = grad.clone()
            adamw = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=False)
            with correctly_rounded_sqrt():
                adamw.step()
            out, m, v = torch.full_like(w0, float("nan")), torch.zeros_like(w0), torch.zeros_like(w0)
            kernels.adam_step_(out, grad, w0.clone(), m, v, None, tile=tile, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, decoupled=True, amsgrad=False, maximize=False, lr=1e-3,
                               step=1)  # fmt: skip
            state = adamw.state[p]
            assert torch.equal(out, p.detach())
            assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])
    finally:
        torch.set_num_threads(previous)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_past_the_stream_threshold_param_and_backup_exchange_their_memory_instead_of_copying(dtype):
    """Past ``cpu_stream_threshold_bytes()``, where param and backup are each the whole of their own storage
    (csrc/cpu/exchange.h): ``perturb_`` writes w + eps into the backup and exchanges the two storages' memory, so param
    holds w + eps and backup w, and every view of param follows; ``sgd_step_`` and ``adam_step_`` exchange them back
    and update param in place, and SAM's restore ``restore_discarding_backup_`` exchanges them back alone, which leaves backup
    holding w + eps and param at its first address. The same bits as the copying path, which a parameter that is only
    part of its storage still takes, and within the cache nothing is exchanged."""
    kernels = torch.ops.gearsam_fused
    tile = 1024
    n = (stream_threshold_elements(dtype) // tile + 3) * tile
    g = torch.Generator().manual_seed(5)
    w0, grad = torch.randn(n, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)
    scales, block_of_tile = torch.tensor([0.01, 0.0], dtype=torch.float64), torch.arange(n // tile) % 2
    block_of_tile = block_of_tile.to(torch.int32)
    perturbed = torch.where(
        (block_of_tile == 0).repeat_interleave(tile), w0 + grad * torch.tensor(0.01, dtype=dtype), w0
    )
    sgd = dict(lr=0.1, weight_decay=5e-4, momentum=0.9, dampening=0.0, nesterov=False, maximize=False, first=False)
    adam = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, amsgrad=False, maximize=False,
                lr=1e-3, step=2)  # fmt: skip
    expected = {}
    for name, update in (
        ("sgd", lambda p, b, st: kernels.sgd_step_(p, grad, b, st[0], tile=tile, **sgd)),
        ("adam", lambda p, b, st: kernels.adam_step_(p, grad, b, *st, None, tile=tile, **adam)),
        ("restore", lambda p, b, st: kernels.restore_discarding_backup_(p, b, tile=tile)),
    ):
        # the copying path: a parameter that starts one tile into its storage
        storage = torch.cat([torch.zeros(tile, dtype=dtype), w0])
        param, backup, state = storage[tile:], torch.empty_like(w0), [grad * 0.5, grad.abs() * 0.1]
        kernels.perturb_(param, grad, backup, scales, block_of_tile, tile=tile, adaptive=False, eta=0.0)
        assert param.data_ptr() == storage.data_ptr() + tile * dtype.itemsize and torch.equal(param, perturbed)
        update(param, backup, state)
        expected[name] = (param.clone(), [s.clone() for s in state])

        param, backup, state = w0.clone(), torch.empty_like(w0), [grad * 0.5, grad.abs() * 0.1]
        views = [param[:10], param[tile:].view(-1, tile)]  # e.g. the model's parameters
        here, there = param.data_ptr(), backup.data_ptr()
        kernels.perturb_(param, grad, backup, scales, block_of_tile, tile=tile, adaptive=False, eta=0.0)
        assert (param.data_ptr(), backup.data_ptr()) == (there, here)
        assert torch.equal(param, perturbed) and torch.equal(backup, w0)
        assert views[0].data_ptr() == there and torch.equal(views[1], perturbed[tile:].view(-1, tile))
        update(param, backup, state)
        assert (param.data_ptr(), backup.data_ptr()) == (here, there) and views[0].data_ptr() == here
        assert torch.equal(backup, perturbed)
        want, want_state = expected[name]
        assert torch.equal(param, want) and all(torch.equal(a, b) for a, b in zip(state, want_state))
        assert torch.equal(views[0], want[:10])
    assert torch.equal(expected["restore"][0], w0)

    small = torch.randn(4 * tile, generator=g, dtype=dtype)
    param, backup = small.clone(), torch.empty_like(small)
    here = param.data_ptr()
    kernels.perturb_(param, small, backup, scales[:1], torch.zeros(4, dtype=torch.int32), tile=tile, adaptive=False,
                     eta=0.0)  # fmt: skip
    assert param.data_ptr() == here and torch.equal(backup, small)
    kernels.restore_discarding_backup_(param, backup, tile=tile)
    assert param.data_ptr() == here and torch.equal(param, small) and torch.equal(backup, small)


@needs_cpp
def test_past_the_stream_threshold_the_sync_passes_over_a_bucket_whose_memory_was_exchanged():
    """The sync's common case (``Bucket.owns_every_tensor``) follows the parameters into the backup's memory: between
    the perturbation, which exchanged the buffers' memory, and the fused AdamW step, with the gradients in place, it
    holds, and a parameter replaced there still fails it and is re-homed by the per-parameter path."""
    features = math.isqrt(stream_threshold_elements(torch.float32)) + 64  # one weight past the threshold
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, features), nn.Linear(features, 2))
    opt = SAM(model, torch.optim.AdamW, backend="cpp", lr=1e-3)
    (bucket,) = opt.backend.layout.buckets
    home = model[0].weight.data_ptr()
    x = torch.randn(4, features)
    for replace in (False, True):
        opt.zero_grad(set_to_none=False)
        model(x).square().sum().backward()
        opt.first_step()
        assert model[0].weight.data_ptr() != home, "the perturbation exchanged no memory: nothing was tested"
        model(x).square().sum().backward()
        assert bucket.owns_every_tensor()
        if replace:
            model[1].bias.data = model[1].bias.detach().clone()
            assert not bucket.owns_every_tensor()
        opt.second_step()
        assert bucket.owns_every_tensor() and model[0].weight.data_ptr() == home
        bias = next(slot for slot in bucket.slots if slot.param is model[1].bias)
        assert model[1].bias.data_ptr() == bias.view.data_ptr()  # re-homed


@needs_cpp
@pytest.mark.parametrize("base", ["rmsprop", "sgd-per-tensor"])
def test_past_the_stream_threshold_sams_restore_exchanges_the_memory_back_where_the_base_step_is_not_fused(base):
    """Where the base step is the base optimizer's own (RMSprop, which is never fused; SGD with
    ``base_step="per-tensor"``) and in ``cancel_step``, SAM's restore (``restore_discarding_backup_``) exchanges the buffers'
    memory back instead of copying w: every parameter is at its own address again after the step, and the steps give
    the bits of the ``torch`` backend, which copies (the same gradients given to both, so that the energies' order of
    summation, which differs, reaches only the perturbed weights)."""
    features = math.isqrt(stream_threshold_elements(torch.float32)) + 64  # one weight past the threshold
    base_cls, kwargs = {
        "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9)),
        "sgd-per-tensor": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, base_step="per-tensor")),
    }[base]
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(features, features), nn.Linear(features, 2))]
    models.append(copy.deepcopy(models[0]))
    opts = [SAM(m, base_cls, backend=b, **kwargs) for m, b in zip(models, ("cpp", "torch"))]
    home = models[0][0].weight.data_ptr()

    def give(seed):
        for model in models:
            g = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)

    for i in range(3):
        give(2 * i)
        if i == 1:
            for opt in opts:
                opt.first_step(cancellable=True)
            assert models[0][0].weight.data_ptr() != home, "the perturbation exchanged no memory: nothing was tested"
            for opt in opts:
                opt.cancel_step()
            assert models[0][0].weight.data_ptr() == home, "cancel_step left the weight in the backup's memory"
            assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
        for opt in opts:
            opt.first_step(zero_grad=True)
        assert models[0][0].weight.data_ptr() != home
        give(2 * i + 1)
        for opt in opts:
            opt.second_step(zero_grad=True)
        assert opts[0].base_step_mode == "per-tensor"
        assert models[0][0].weight.data_ptr() == home, "second_step left the weight in the backup's memory"
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b), f"{(a - b).abs().max():.3g} from the torch backend after step {i}"


STREAMED_UPDATES = {
    "sgd-nesterov-maximize": ("sgd", dict(lr=0.1, weight_decay=5e-4, momentum=0.9, dampening=0.0, nesterov=True,
                                          maximize=True, first=False)),
    "sgd-first-dampening": ("sgd", dict(lr=0.05, weight_decay=0.0, momentum=0.5, dampening=0.1, nesterov=False,
                                        maximize=False, first=True)),
    "sgd-plain": ("sgd", dict(lr=0.1, weight_decay=1e-3, momentum=0.0, dampening=0.0, nesterov=False, maximize=False,
                              first=False)),
    "adamw": ("adam", dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, amsgrad=False,
                           maximize=False, lr=1e-3, step=7)),
    "adam-l2-amsgrad-maximize": ("adam", dict(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.01, decoupled=False,
                                              amsgrad=True, maximize=True, lr=1e-2, step=3)),
}  # fmt: skip


def _update(kind: str, kw: dict, out, grad, backup, state, tile: int, correction) -> None:
    kernels = torch.ops.gearsam_fused
    if kind == "sgd":
        kernels.sgd_step_(out, grad, backup, state[0] if kw["momentum"] else None, tile=tile, **kw, **correction)
    else:
        kernels.adam_step_(out, grad, backup, *state[:2], state[2] if kw["amsgrad"] else None, tile=tile, **kw,
                           **correction)  # fmt: skip


@needs_cpp
@pytest.mark.parametrize("corrected", ["", "corrected", "sharpened"])
@pytest.mark.parametrize("name", list(STREAMED_UPDATES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_streamed_updates_equal_the_same_update_unstreamed(dtype, name, corrected):
    """The fused base steps past the stream threshold (vector loops that stream the parameter out, vec.h; and, for a
    parameter that is not 32-byte aligned, the scalar loop through scratch) against the same step on the same values
    in two halves, each below the threshold (the scalar loops, no streaming): the same bits for every flag of SGD and
    Adam, without a correction, with LookSAM's, and with the SAM family's mix and WSAM's sharpness step."""
    kind, kw = STREAMED_UPDATES[name]
    tile = 1024
    n = (stream_threshold_elements(dtype) // tile + 3) * tile
    half = n // tile // 2 * tile
    g = torch.Generator().manual_seed(3)
    grad, backup = torch.randn(n, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)
    state = [torch.randn(n, generator=g, dtype=dtype) * 0.1, torch.rand(n, generator=g, dtype=dtype) * 0.01]
    state.append(state[1] * 1.5)
    # NaN on either side of amsgrad's maximum, which keeps it (torch.maximum's rule), in vectors as in the scalar loop
    state[1][5::4099], state[2][9::4099] = float("nan"), float("nan")
    correction = {}
    if corrected:
        block_of_tile = torch.arange(n // tile, dtype=torch.int32) % 3
        correction = {"correction": torch.randn(n, generator=g, dtype=dtype), "block_of_tile": block_of_tile,
                      "correction_scale": torch.tensor([0.5, -0.25, 0.125], dtype=torch.float64)}  # fmt: skip
    if corrected == "sharpened":
        correction.update(grad_scale=torch.tensor([1.5, 0.0, -2.0], dtype=torch.float64), sharpness=2.3)

    def piece(lo, hi):
        part = dict(correction)
        if corrected:
            part["correction"] = correction["correction"][lo:hi]
            part["block_of_tile"] = correction["block_of_tile"][lo // tile : hi // tile]
        out, st = torch.full((hi - lo,), float("nan"), dtype=dtype), [s[lo:hi].clone() for s in state]
        _update(kind, kw, out, grad[lo:hi], backup[lo:hi].clone(), st, tile, part)
        return out, st

    (out_a, st_a), (out_b, st_b) = piece(0, half), piece(half, n)
    expected = [torch.cat(pair) for pair in zip([out_a, *st_a], [out_b, *st_b])]
    aligned = torch.full((n,), float("nan"), dtype=dtype)
    unaligned = torch.full((n + 1,), float("nan"), dtype=dtype)[1:]  # 4 or 8 bytes past a 32-byte boundary
    for out in (aligned, unaligned):  # the first exchanges its memory with the backup's (exchange.h), then in place
        st = [s.clone() for s in state]
        _update(kind, kw, out, grad, backup.clone(), st, tile, correction)
        for got, want in zip([out, *st], expected):
            where = ("unaligned" if out is unaligned else "aligned", name)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")


# ------------------------------------------------------------------------------------------- errors
def test_missing_extension_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(cpp_backend, "_load", lambda: (None, "No module named 'gearsam_fused._C'"))
    with pytest.raises(ValueError, match=r"not built \(No module named .*pip install --no-build-isolation -e \."):
        SAM(WideNet(), torch.optim.SGD, backend="cpp", lr=0.1)
    assert resolve_backend_name("auto", {torch.device("cpu")}) == "torch"


@needs_cpp
@pytest.mark.skipif(cpp_built_with_cuda(), reason="this build has CUDA kernels")
def test_cpu_only_build_refuses_cuda_parameters():
    with pytest.raises(
        ValueError, match=r"built without CUDA kernels, but parameters are on CUDA; reinstall with nvcc"
    ):
        resolve_backend_name("cpp", {torch.device("cuda", 0)})
    # the operators' CUDA key is registered in every build, so a direct call says the same instead of "could not run"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("gearsam_fused::restore_", "CUDA")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="has no CUDA kernels; reinstall with nvcc on PATH"):
            torch.ops.gearsam_fused.restore_(torch.empty(8, device="cuda"), torch.empty(8, device="cuda"), tile=8)


@needs_cpp
def test_operators_check_meta_tensors_and_refuse_tensors_they_have_no_kernel_for():
    """Meta tensors run the fake implementation (gearsam_fused/backends/cpp_fakes.py): its checks (torch._check's
    RuntimeError), no data. A kind of tensor with neither a kernel nor a fake, such as a sparse one, is refused by the
    dispatcher, naming the operator."""
    kernels = cpp_backend._load()[0]
    meta = torch.empty(8, device="meta")
    kernels.restore_(meta, torch.empty(8, device="meta"), tile=8)
    with pytest.raises(RuntimeError, match=r"param has 8 elements, not a multiple of the tile \(3\)"):
        kernels.restore_(meta, torch.empty(8, device="meta"), tile=3)
    sparse = torch.zeros(8).to_sparse()
    with pytest.raises(NotImplementedError, match="Could not run 'gearsam_fused::restore_' with arguments from the "
                       "'SparseCPU' backend"):  # fmt: skip
        kernels.restore_(sparse, sparse.clone(), tile=8)


# ------------------------------------------------------------------------------------------- CUDA sources
def _nvcc_compile(source: Path, out_dir: Path, shim: Path) -> subprocess.CompletedProcess:
    """Compile one .cu file for sm_90 as setup.py would (same defines and torch headers), keeping its PTX."""
    from torch.utils import cpp_extension

    includes = [f"-I{d}" for d in [shim, CSRC, *cpp_extension.include_paths()]]
    command = [
        "nvcc", "-c", str(source), "-o", str(out_dir / f"{source.stem}.o"), "-std=c++20", "-O3", "-DWITH_CUDA",
        "-gencode", "arch=compute_90,code=[sm_90,compute_90]", "--compiler-options", "-fPIC", "-keep",
        "-keep-dir", str(out_dir), *cpp_extension.COMMON_NVCC_FLAGS, *includes,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


#: each CUDA source and its kernels: 4 dtypes x adaptive x vectorised-or-not; 4 dtypes x ({square, adaptive square,
#: product} + F-SAM's ascent with {square, adaptive square}) x vectorised-or-not + block sum; 2 rules; {sgd, adam} x
#: {float32, float64} x vectorised-or-not; {mix, exchange, friendly ascent} x 4 dtypes x vectorised-or-not. The
#: perturbation first: the default tier compiles it alone (it holds the subtlest check, below)
CUDA_KERNELS = {"perturb": 16, "energy": 41, "allocation": 2, "base_step": 8, "mix": 24}


def test_the_cuda_sources_are_the_ones_compiled_below():
    assert sorted(s.stem for s in (CSRC / "cuda").glob("*.cu")) == sorted(CUDA_KERNELS)


@pytest.mark.heavy  # a build each
@pytest.mark.parametrize("name", list(CUDA_KERNELS))
def test_every_cuda_source_compiles_for_hopper_without_atomics(tmp_path, name):
    """Compiles a csrc/cuda/*.cu with this machine's nvcc (no GPU needed), then reads the PTX: every kernel is there,
    none uses atomics (reductions keep their fixed order), and the perturbation contains no fused multiply-add (it
    must round like the reference's separate multiply and add)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    # A CPU build of torch ships the c10/cuda headers but not this one header generated by its CUDA build.
    shim = tmp_path / "shim"
    (shim / "c10/cuda/impl").mkdir(parents=True)
    (shim / "c10/cuda/impl/cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    result = _nvcc_compile(CSRC / "cuda" / f"{name}.cu", tmp_path, shim)
    assert result.returncode == 0, f"{name}.cu:\n{result.stderr[-4000:]}"
    ptx = (tmp_path / f"{name}.ptx").read_text()
    assert len(re.findall(r"\.entry (\w+)", ptx)) == CUDA_KERNELS[name], re.findall(r"\.entry (\w+)", ptx)
    assert not re.search(r"^\s*(atom|red)\.", ptx, re.MULTILINE), f"{name}.cu uses atomics"
    assert name != "perturb" or not re.search(r"^\s*fma\.", ptx, re.MULTILINE)
