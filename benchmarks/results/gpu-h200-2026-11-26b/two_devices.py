"""Repro of the cpp crash on a model split over the CPU and CUDA (guard bypassed); prints each kernel call first."""
import faulthandler
import sys

import torch
from torch import nn

faulthandler.enable()
from gearsam_fused import GEARSAM  # noqa: E402
from gearsam_fused.backends import cpp_ops  # noqa: E402

cpp_ops.CppBackend.check_usable = staticmethod(lambda devices: None)


def describe(t):
    if isinstance(t, torch.Tensor):
        return f"{t.device}/{t.dtype}/{tuple(t.shape)}/{t.stride()}/{t.data_ptr():#x}"
    return repr(t)


class Traced:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*args, **kw):
            print("CALL", name, [describe(a) for a in args], {k: describe(v) for k, v in kw.items()}, flush=True)
            out = fn(*args, **kw)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            print("DONE", name, flush=True)
            return out

        return call


mode = sys.argv[1]
torch.manual_seed(0)
first, second = nn.Linear(6, 5), nn.Linear(5, 3)
if mode in ("split", "cuda"):
    second = second.cuda()
if mode == "cuda":
    first = first.cuda()
if mode == "cpu" and torch.cuda.is_available():
    torch.zeros(1, device="cuda")  # CUDA initialised, the model on the CPU
params = [*first.parameters(), *second.parameters()]
opt = GEARSAM(params, torch.optim.SGD, partition="tensor", backend="cpp", lr=0.01, momentum=0.9, weight_decay=5e-4)
opt.backend.kernels = Traced(opt.backend.kernels)
d1, d2 = next(first.parameters()).device, next(second.parameters()).device
for step in range(3):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)

    def loss():
        return nn.functional.cross_entropy(second(first(x.to(d1)).to(d2)), y.to(d2))

    loss().backward()
    print("step", step, "first_step", flush=True)
    opt.first_step(zero_grad=True)
    loss().backward()
    print("step", step, "second_step", flush=True)
    opt.second_step(zero_grad=True)
print("OK", mode, flush=True)
