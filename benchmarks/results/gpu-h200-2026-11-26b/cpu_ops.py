"""One C++ CPU operator on small CPU tensors, by name: which of them crash on this machine."""
import faulthandler
import sys

import torch

faulthandler.enable()
import gearsam_fused.backends.cpp_ops as cpp_ops  # noqa: E402

cpp_ops.cpp_installed()
ops = torch.ops.gearsam_fused
what = sys.argv[1]
n, tile = 8192, 2048
p, g, b = torch.randn(n), torch.randn(n), torch.empty(n)
scale, tiles = torch.full((1,), 1e-3, dtype=torch.float64), torch.zeros(n // tile, dtype=torch.int32)
first = torch.tensor([0, n // tile]); partials = torch.empty(n // tile, dtype=torch.float64)
print("start", what, flush=True)
if what == "threshold":
    from gearsam_fused import _C
    print(_C.cpu_stream_threshold_bytes(), flush=True)
elif what == "energy":
    print(ops.block_energy(g, p, first, partials, tile=tile, adaptive=False, eta=0.0))
elif what == "restore":
    ops.restore_(b, p, tile=tile)
elif what == "perturb":
    ops.perturb_(p, g, b, scale, tiles, tile=tile, adaptive=False, eta=0.0)
elif what == "sgd":
    ops.sgd_step_(p, g, None, None, tile=tile, weight_decay=0.0, momentum=0.0, dampening=0.0, nesterov=False,
                  maximize=False, lr=0.1, first=True)
print("OK", what, flush=True)
