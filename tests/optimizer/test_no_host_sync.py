"""No host synchronisation inside a step, checked on CPU: ``first_step`` and ``second_step`` never bring a value
that would live on the device (parameters, gradients, the flat buffers, the optimizer state, energies, EMA, radii,
or anything computed from them) to the host. On a GPU each such read waits for the device; test_engine.py checks
that with CUDA's own detector, where a GPU is present.

On CPU every tensor is a host tensor, so :class:`HostReads` tells the two kinds apart by where a value comes from. A
tensor is *host* when it is a CPU value by design, which torch itself keeps on the CPU on a GPU too: Adam's step
counts (``state[p]["step"]`` and the flat vector they are views of) and hyperparameters given as CPU tensors
(``lr``, ``betas``), or when it is computed inside the step from host tensors and Python numbers only. Every other
tensor is a *device* tensor: those that existed before the step, those a kernel launcher returns, and those computed
from a device tensor (an operation that writes into a tensor makes it a device tensor when any of its inputs is
one). Reading a device tensor's value on the host is recorded, by every route there is: ``item()``, ``tolist()``,
``numpy()``, ``cpu()``, ``to("cpu")``, ``bool()``, ``float()``, ``int()``, ``operator.index()``, ``format()``, and torch
operations whose result depends on the values (``aten._local_scalar_dense``, through which every C++ read of a
scalar goes, ``equal``, ``allclose``; and those whose output shape does: ``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``). The kernels' own work (Triton's interpreter, the C++ extension's CPU loops) is the
device's, and not looked into."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.backends.triton_backend import triton_installed

from conftest import ALL, batches, loss_fn, on_device, sam_step, tiny_resnet

#: The Tensor methods that hand a tensor's value to Python, or copy it to the host.
_READ_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__format__")

#: What torch.tensor(python data) runs its new tensor through.
_LIFT = (torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy, torch.ops.aten.lift)


def _tensors(*trees) -> list[torch.Tensor]:
    return [t for t in tree_flatten(trees)[0] if isinstance(t, torch.Tensor)]


def _depends_on_values(func, args, kwargs) -> bool:
    """Whether the result of ``func`` (its values, or its shape) depends on the values of its inputs. Indexing is
    tagged so for its boolean masks, which it turns into indices (indexing with integer indices is a gather), and
    ``repeat_interleave`` for its output size, unless it is given."""
    if func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_):
        return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1]))
    if func.overloadpacket is torch.ops.aten.repeat_interleave and kwargs.get("output_size") is not None:
        return False
    return bool({torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape} & set(func.tags))


def _moves_to_host(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the CPU as its destination, as a string: a ``torch.device``
    cannot be told from the parameters' own device (``.to(p.device)``) on a CPU."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, str) and torch.device(value).type == "cpu":
            return True
    return False


class HostReads(TorchDispatchMode):
    """Records, while active, every host read of a device tensor's value (see the module's docstring) as
    ``(route, shape)`` in :attr:`reads`. ``host`` are the tensors that are CPU values by design."""

    def __init__(self, host: list[torch.Tensor]):
        super().__init__()
        self.reads: list[tuple[str, tuple]] = []
        # a tensor's kind, keyed by its storage: views and in-place writes share it. A storage made inside the step
        # gets its kind when it is made, so an address reused within the step never keeps a stale one.
        self._kind: dict[int, str] = {}
        self._host = {t.untyped_storage().data_ptr() for t in host}
        self._kernel_depth = 0

    def on_device(self, t: torch.Tensor) -> bool:
        address = t.untyped_storage().data_ptr()
        if address == 0:  # no elements: nothing to read
            return False
        kind = self._kind.get(address)
        if kind is None:  # it existed before the step
            return address not in self._host
        return kind == "device"

    def _mark(self, tensors, kind: str) -> None:
        for t in tensors:
            if t.untyped_storage().data_ptr():
                self._kind[t.untyped_storage().data_ptr()] = kind

    def _read(self, route: str, t: torch.Tensor) -> None:
        if not self._kernel_depth and self.on_device(t):
            self.reads.append((route, tuple(t.shape)))

    # -- the Python routes
    def _watch(self, name: str, original):
        mode = self

        def watched(t, *args, **kwargs):
            if name != "to" or _moves_to_host(args, kwargs):
                mode._read(name, t)
            return original(t, *args, **kwargs)

        return watched

    def _launch(self, original):
        """A kernel launch: not looked into; what it is given and what it returns is device memory."""

        def launched(*args, **kwargs):
            self._kernel_depth += 1
            try:
                out = original(*args, **kwargs)
            finally:
                self._kernel_depth -= 1
            if not self._kernel_depth:
                self._mark(_tensors(args, kwargs, out), "device")
            return out

        return launched

    def __enter__(self):
        targets = [(torch.Tensor, name, self._watch) for name in (*_READ_METHODS, "to")]
        if triton_installed():
            import triton.runtime.interpreter as interpreter
            import triton.runtime.jit as jit

            kernels = (jit.JITFunction, interpreter.InterpretedFunction)
            targets += [(cls, "run", lambda _, f: self._launch(f)) for cls in kernels]
        self._originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
        for owner, name, wrap in targets:
            setattr(owner, name, wrap(name, getattr(owner, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        return super().__exit__(*exc)

    # -- the torch operations
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "gearsam_fused":
            # the compiled extension's launchers (operators, csrc/library.cpp): what runs inside them is the device's
            # work, as are Triton's kernels
            return self._launch(func)(*args, **kwargs)
        out = func(*args, **kwargs)
        if self._kernel_depth:
            return out
        inputs = _tensors(args, kwargs)
        # torch.tensor(python data) hands its new tensor to lift_fresh: a host value, made from Python numbers
        device = func.overloadpacket not in _LIFT and any(self.on_device(t) for t in inputs)
        if device and _depends_on_values(func, args, kwargs):
            self.reads.append((func.overloadpacket.__name__, tuple(inputs[0].shape)))
        # the outputs, and the inputs an operation writes into, take the kind of what went in
        schema = func._schema.arguments
        written = [i for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write]
        targets = _tensors(out, [args[i] if i < len(args) else kwargs.get(schema[i].name) for i in written])
        self._mark(targets, "device" if device else "host")
        return out


def host_by_design(opt) -> list[torch.Tensor]:
    """The base optimizer's CPU step counts and CPU-tensor hyperparameters: torch keeps them on the host."""
    host = [state["step"] for state in opt.base_optimizer.state.values() if isinstance(state.get("step"), torch.Tensor)]
    for group in opt.param_groups:
        host += _tensors([v for k, v in group.items() if k not in ("params", "gearsam")])
    backend = getattr(opt, "_backend", None)
    for bucket in getattr(getattr(backend, "layout", None), "buckets", []):
        host += _tensors(bucket._counts)
    return host


def checked_steps(opt, model, data) -> list[tuple[str, tuple]]:
    """A warm-up step, then steps whose first_step and second_step run under :class:`HostReads`."""
    sam_step(opt, model, data[0])
    reads = []
    for xy in data[1:]:
        for step in (opt.first_step, opt.second_step):
            loss_fn(model, xy).backward()
            with HostReads(host_by_design(opt)) as watch:
                step(zero_grad=True)
            reads += watch.reads
    return reads


BASES = {
    "sgd": (torch.optim.SGD, dict(lr=0.01, momentum=0.9, weight_decay=5e-4, nesterov=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01, amsgrad=True)),
    # float64: torch's Adam rounds what it computes from a narrower tensor in its dtype, and such a step is per tensor
    "adam-tensor-lr": (
        torch.optim.Adam,
        dict(
            lr=torch.tensor(1e-3, dtype=torch.float64),
            betas=(torch.tensor(0.9, dtype=torch.float64), torch.tensor(0.99, dtype=torch.float64)),
        ),
    ),
}
CPU = [case for case in ALL if case.values[1] == "cpu"] + [on_device("sharded", "cpu")]


@pytest.mark.parametrize("backend,device", CPU)
@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_a_step_reads_no_device_value_on_the_host(backend, device, base, cls):
    """ASAM and GEAR-SAM on every backend that runs here, with SGD, AdamW (amsgrad) and Adam with CPU-tensor
    hyperparameters; the base step fused on the flat-buffer backends, per tensor (torch's own) on the others."""
    model = tiny_resnet()
    base_cls, kw = BASES[base]
    opt = cls(model, base_cls, rho=0.05, adaptive=cls is SAM, backend=backend, **copy.deepcopy(kw))
    reads = checked_steps(opt, model, batches(3))
    fusable = backend in ("torch", "triton", "cpp")
    assert opt.base_step_mode == ("fused" if fusable else "per-tensor"), opt.base_step_reason
    assert reads == []


@pytest.mark.parametrize("backend,device", CPU)
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_a_non_finite_gradient_is_handled_without_reading_it_on_the_host(backend, device, cls):
    """An inf in one block's gradient: GEAR-SAM skips that block, SAM the whole perturbation, on the device."""
    model = tiny_resnet()
    opt = cls(model, torch.optim.SGD, rho=0.05, backend=backend, lr=0.01, momentum=0.9)
    data = batches(2)
    sam_step(opt, model, data[0])
    loss_fn(model, data[1]).backward()
    model.fc.weight.grad[0, 0] = float("inf")
    with HostReads(host_by_design(opt)) as watch:
        opt.first_step(zero_grad=True)
    loss_fn(model, data[1]).backward()
    with HostReads(host_by_design(opt)) as watch_second:
        opt.second_step(zero_grad=True)
    assert opt.block_stats()["non_finite"] == 1  # the classifier's block
    assert watch.reads == [] and watch_second.reads == []


def test_the_step_counts_and_tensor_hyperparameters_are_read_on_the_host():
    """The fused Adam step reads its CPU step counts and its CPU-tensor learning rate, which the check allows: it
    sees those reads, and only they are allowed."""
    model = tiny_resnet()
    base_cls, kw = BASES["adam-tensor-lr"]
    opt = SAM(model, base_cls, rho=0.05, backend="torch", **copy.deepcopy(kw))
    sam_step(opt, model, batches(1)[0])
    loss_fn(model, batches(1)[0]).backward()
    opt.first_step(zero_grad=True)
    loss_fn(model, batches(1)[0]).backward()
    with HostReads([]) as watch:  # nothing allowed
        opt.second_step(zero_grad=True)
    assert opt.base_step_mode == "fused"
    assert watch.reads, "the fused Adam step reads its step counts and learning rate on the host"


def _reads(body) -> list[tuple[str, tuple]]:
    model = tiny_resnet()
    loss_fn(model, batches(1)[0]).backward()
    weight = model.fc.weight
    with HostReads([]) as watch:
        body(weight, weight.grad)
    return watch.reads


@pytest.mark.parametrize(
    "route,body",
    [
        ("item", lambda w, g: g.sum().item()),
        ("__float__", lambda w, g: float(g.norm())),
        ("__bool__", lambda w, g: bool((w > 0).any())),
        ("__int__", lambda w, g: int(w.argmax())),
        ("__format__", lambda w, g: f"{g.sum():.3f}"),
        ("tolist", lambda w, g: w[0].tolist()),
        ("cpu", lambda w, g: g.sum().cpu()),
        ("to", lambda w, g: (w * 2).to("cpu")),
        ("numpy", lambda w, g: g.numpy()),
        ("nonzero", lambda w, g: (g > 0).nonzero()),
        ("index", lambda w, g: w[g > 0]),
        ("repeat_interleave", lambda w, g: w[0].repeat_interleave(g[0].abs().long())),
        ("equal", lambda w, g: torch.equal(w, g)),
        ("is_nonzero", lambda w, g: torch.ops.aten.is_nonzero(g.sum())),
    ],
)
def test_every_route_to_the_host_is_seen(route, body):
    reads = _reads(body)
    assert reads and reads[0][0] in (route, "_local_scalar_dense", "index"), reads


def test_python_numbers_and_tensors_made_from_them_are_host_values():
    assert _reads(lambda w, g: torch.tensor([0.5, 2.0]).sum().item() + float(torch.full((), 3.0))) == []


@pytest.mark.parametrize("backend,device", CPU)
def test_a_read_added_to_the_step_is_caught(monkeypatch, backend, device):
    """A float() of the energies inside first_step (in the backend's allocation): the check sees it."""
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, lr=0.1)
    allocate = type(opt.backend).allocate

    def allocate_and_read(self, rule, energy, *args):
        float(energy.sum())
        return allocate(self, rule, energy, *args)

    monkeypatch.setattr(type(opt.backend), "allocate", allocate_and_read)
    reads = checked_steps(opt, model, batches(2))
    assert reads[0] == ("__float__", ()), reads
