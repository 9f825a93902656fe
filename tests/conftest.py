import contextlib
import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if "PYTEST_XDIST_WORKER" in os.environ and not torch.cuda.is_available():
    # One of several test processes (pytest -n) sharing the CPU: a thread each, or their threads wait on one another.
    # The processes the tests start inherit the count, so that they compute what this process computes; and they are
    # not xdist's workers (pytest-benchmark would stop measuring in a benchmark run they start).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    for name in [name for name in os.environ if name.startswith("PYTEST_XDIST_")]:
        del os.environ[name]

CUDA = torch.cuda.is_available()
if not CUDA:
    # Triton kernels run on CPU tensors through the interpreter; it must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # The test models' own CUDA backward (cuDNN convolutions) may otherwise pick non-deterministic algorithms and
    # TF32 arithmetic, which would move gradients between identical runs and between batch splits: the tests compare
    # what the optimizer does with a gradient, so the gradient must be the same every time.
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

from gearsam_fused import set_state_debug_mode  # noqa: E402
from gearsam_fused.backends.cpp_backend import cpp_built_with_cuda, cpp_installed  # noqa: E402
from gearsam_fused.backends.triton_backend import interpreter_enabled, triton_installed  # noqa: E402
from gearsam_fused.models import ResNet  # noqa: E402

pytest_plugins = ["tiers"]  # the default and the full tier (tests/tiers.py)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_addoption(parser):
    parser.addoption(
        "--part", metavar="K/N", default=None,
        help="run the K-th of N parts of the selected tests: every N-th one from the K-th, in collection order "
             "(neighbouring cases of one test land in different parts), so that a suite too long for one run of a "
             "time-limited machine splits over N runs that together run each selected test once",
    )  # fmt: skip


def parse_part(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)``, refusing anything but 1 <= K <= N."""
    k, slash, n = text.partition("/")
    if not (slash and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"--part must be K/N with 1 <= K <= N (whole numbers), got {text!r}")
    return int(k), int(n)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs: the parts split what is left
def pytest_collection_modifyitems(config, items):
    if config.getoption("--part") is None:
        return
    k, n = parse_part(config.getoption("--part"))
    kept = [item for i, item in enumerate(items) if i % n == k - 1]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k - 1])
    items[:] = kept


@pytest.fixture(autouse=True)
def _thread_count_restored():
    """Every test leaves torch's thread count as it found it: the command line's ``--threads`` sets it in this
    process, and results depend on it (the order of float sums), so a test after one that ran ``gearsam ...
    --threads 1`` would otherwise compare a run on one thread with one on all of them."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def state_debug_mode():
    """``gearsam_fused.set_state_debug_mode(True)`` for one test: every step checks the optimizer state."""
    set_state_debug_mode(True)
    yield
    set_state_debug_mode(False)


def on_device(backend: str, device: str):
    """A (backend, device) test case, skipped where it cannot run."""
    marks = []
    if device == "cuda":
        marks += [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
    if backend == "triton":
        marks.append(pytest.mark.skipif(not triton_installed(), reason="triton is not installed"))
        if device == "cpu":
            marks.append(pytest.mark.skipif(not interpreter_enabled(), reason="triton on CPU needs TRITON_INTERPRET=1"))
    if backend == "cpp":
        # kernels/test_cpp_extension.py fails when a compiler was there to build it: this skip cannot hide a broken build
        marks.append(pytest.mark.skipif(not cpp_installed(), reason="the C++ extension is not built"))
        if device == "cuda":
            marks.append(pytest.mark.skipif(not cpp_built_with_cuda(), reason="the C++ extension has no CUDA kernels"))
    return pytest.param(backend, device, marks=marks, id=f"{backend}-{device}")


#: Every fused backend on every device.
FUSED = [on_device(b, d) for d in ("cpu", "cuda") for b in ("torch", "triton", "cpp")]
#: Every backend on every device.
ALL = [on_device(b, d) for d in ("cpu", "cuda") for b in ("reference", "torch", "triton", "cpp")]
#: The backends that launch kernels of their own (Triton's, or the compiled extension's), on every device.
KERNELS = [case for case in FUSED if case.values[0] in ("triton", "cpp")]


def kernel_module(backend: str):
    """The launchers a kernel backend calls: same names and arguments for both."""
    if backend == "triton":
        from gearsam_fused import triton_kernels

        return triton_kernels
    from gearsam_fused.backends.cpp_backend import _load

    return _load()[0]  # torch.ops.gearsam_fused


class NoStep(torch.optim.Optimizer):
    """A base optimizer that never changes anything: isolates what SAM itself does to the weights."""

    def __init__(self, params, **kwargs):
        super().__init__(params, kwargs)

    def step(self, closure=None):
        return None


#: The base optimizer of the trajectory tests: SGD with momentum and weight decay.
SGD_KW = dict(lr=0.01, momentum=0.9, weight_decay=5e-4)

# Relative error allowed between whole parameter vectors, per step.
FP32_STEP_RTOL = 1e-6
FP64_STEP_RTOL = 1e-10


def stream_threshold_elements(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` past which the CPU kernels stream their outputs (skips where they never do, or where a
    buffer past it is too large for a test)."""
    from gearsam_fused import _C

    threshold = _C.cpu_stream_threshold_bytes()
    if threshold < 0:
        pytest.skip("this CPU has no non-temporal stores: the kernels never stream")
    if threshold > 2**28:
        pytest.skip(f"a stream threshold of {threshold / 2**20:.0f} MiB: a bucket past it is too large for a test")
    return threshold // dtype.itemsize


def tiny_resnet(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> ResNet:
    """Two-stage ResNet with SiLU: smooth, so trajectory comparisons measure the algorithm, not ReLU kinks."""
    torch.manual_seed(seed)
    return ResNet(blocks=(1, 1), width=4, num_classes=3, act="silu").to(device, dtype)


def batches(n: int, dtype: torch.dtype = torch.float32, batch: int = 16, seed: int = 1, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, 3, 8, 8, generator=g).to(device, dtype),
            torch.randint(0, 3, (batch,), generator=g).to(device),
        )
        for _ in range(n)
    ]


def loss_fn(model, xy):
    x, y = xy
    return F.cross_entropy(model(x), y)


def mlp(seed: int = 0) -> torch.nn.Module:
    """A two-layer perceptron small enough for a compiled step, or Triton's interpreter, to take a few steps fast."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def mlp_data(n: int):
    """``n`` batches of (input, target) for :func:`mlp`, the same every call."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)) for _ in range(n)]


def mse(model, xy):
    x, y = xy
    return F.mse_loss(model(x), y)


def sam_step(opt, model, xy):
    """One two-pass step through first_step/second_step."""
    loss_fn(model, xy).backward()
    opt.first_step(zero_grad=True)
    loss_fn(model, xy).backward()
    opt.second_step(zero_grad=True)


def run_steps(opt, model, data) -> list[bool]:
    """The two-call loop of the README over ``data`` (the second pass only where ``first_step`` returns True, as a
    step schedule decides); returns which steps took it."""
    taken = []
    for xy in data:
        loss_fn(model, xy).backward()
        sam = opt.first_step(zero_grad=True)
        if sam:
            loss_fn(model, xy).backward()
            opt.second_step(zero_grad=True)
        taken.append(sam)
    return taken


def grad_at(model, params: list[torch.Tensor], w: torch.Tensor, xy) -> torch.Tensor:
    """The gradient of :func:`loss_fn` over ``params`` (one vector) at the weights ``w`` (one vector, written into
    ``params``): the float64 re-computations' gradient."""
    torch.nn.utils.vector_to_parameters(w, params)
    model.zero_grad()
    loss_fn(model, xy).backward()
    return torch.cat([p.grad.reshape(-1) for p in params])


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def correct_root(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a float32 or float64 CPU tensor: NumPy's, which is the IEEE operation."""
    return torch.from_numpy(np.sqrt(t.detach().numpy())).reshape(t.shape)


@contextlib.contextmanager
def correctly_rounded_sqrt():
    """While open, torch's square roots of float32 and float64 CPU tensors (``Tensor.sqrt`` and ``torch._foreach_sqrt``,
    what ``torch.optim.Adam``/``AdamW`` take) are correctly rounded. torch's own CPU root comes from MKL on x86 builds
    and misses the correctly rounded one by an ulp for about one float32 in six; the fused Adam kernels take the
    correctly rounded root (gearsam_fused/base_step.py), so torch's optimizer run inside this context is their
    bit-for-bit oracle, every other operation being torch's own."""
    inherited = "sqrt" not in torch.Tensor.__dict__
    tensor_sqrt, foreach_sqrt = torch.Tensor.sqrt, torch._foreach_sqrt

    def sqrt(self):
        if self.device.type == "cpu" and self.dtype in (torch.float32, torch.float64):
            return correct_root(self)
        return tensor_sqrt(self)

    torch.Tensor.sqrt = sqrt
    torch._foreach_sqrt = lambda tensors: [sqrt(t) for t in tensors]
    try:
        yield
    finally:
        torch._foreach_sqrt = foreach_sqrt
        if inherited:
            del torch.Tensor.sqrt
        else:
            torch.Tensor.sqrt = tensor_sqrt


def torch_adam_oracle(backend: str, device: str):
    """The context in which torch's Adam is the bit-for-bit oracle of ``backend``'s fused Adam on ``device``: the
    ``cpp`` CPU kernel takes the correctly rounded root (:func:`correctly_rounded_sqrt`); the ``torch`` backend runs
    torch's own operations, root included (nothing to change)."""
    return correctly_rounded_sqrt() if (backend, device) == ("cpp", "cpu") else contextlib.nullcontext()


@pytest.fixture
def twin():
    """Two bitwise-identical tiny models."""
    model = tiny_resnet()
    return model, copy.deepcopy(model)
