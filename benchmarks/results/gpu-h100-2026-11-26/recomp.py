# How many graphs our compiled first_step/second_step make over 10 steps, per backend and base optimizer
import sys, torch
from torch._dynamo.utils import counters
from gearsam_fused import SAM
dev = "cuda" if torch.cuda.is_available() else "cpu"
for backend in sys.argv[1:] or ["cpp", "triton"]:
    for base in (torch.optim.SGD, torch.optim.AdamW):
        torch._dynamo.reset(); counters.clear()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)).to(dev)
        kw = dict(lr=1e-3) if base is torch.optim.AdamW else dict(lr=0.1, momentum=0.9)
        opt = SAM(model, base, rho=0.05, backend=backend, base_step="fused", foreach=True, **kw)
        first = torch.compile(opt.first_step, fullgraph=True)
        second = torch.compile(opt.second_step, fullgraph=True)
        graphs = []
        for i in range(10):
            for p in model.parameters(): p.grad = torch.randn_like(p)
            first()
            for p in model.parameters(): p.grad = torch.randn_like(p)
            second()
            graphs.append(counters["stats"]["unique_graphs"])
        print(backend, base.__name__, "unique graphs after each step:", graphs, flush=True)
