"""The implementations a benchmark compares, each behind the same two calls: ``first_step()`` and ``second_step()``.

=================================  ===========================================================================
contender                          what it is
=================================  ===========================================================================
``per-tensor loop``                :class:`PerTensorLoopSAM` below: SAM written the way the widely copied
                                   implementation does it
``pytorch_optimizer``              ``pytorch_optimizer.SAM(..., foreach=True)`` (a peer, skipped with a note
                                   when not installed)
``pytorch_optimizer, per tensor``  the same peer with ``foreach=False``, its default on CPU (:data:`PEER_PATHS`)
``reference``                      gearsam_fused's per-tensor oracle backend
``torch``                          gearsam_fused's vectorised flat-buffer backend
``triton``                         gearsam_fused's Triton kernels (CUDA only)
``cpp``                            gearsam_fused's compiled kernels (when the extension is built; on CUDA, when
                                   built with it)
``sharded``                        gearsam_fused's backend for FSDP2 shards: temporary flat copies, tensors left
                                   in place
=================================  ===========================================================================

The peer's best path is not the same on every set and device, so the SAM-step benchmark times both and the report
compares ours with the faster one of the same run.

The per-tensor loop and the peer implement SAM only; ours run both rules (``sam`` and ``gear-sam``). :func:`make`
builds them with a base optimizer that does nothing, so a step measures the SAM machinery alone: energies, allocation,
perturbation and restore. ``bench_whole_step.py`` builds the same implementations around a real base optimizer
(torch's SGD or AdamW).
"""

from __future__ import annotations

import torch

from gearsam_fused import GEARSAM, OPTIMIZERS
from gearsam_fused.backends import BACKENDS

PEER, PEER_PER_TENSOR = "pytorch_optimizer", "pytorch_optimizer, per tensor"
#: the peer's two paths: contender name -> its ``foreach`` argument
PEER_PATHS = {PEER: True, PEER_PER_TENSOR: False}
SAM_ONLY = ("per-tensor loop", *PEER_PATHS)
OURS = ("reference", "torch", "triton", "cpp", "sharded")


class NoStep(torch.optim.Optimizer):
    """A base optimizer that changes nothing."""

    def __init__(self, params, **kwargs):
        super().__init__(params, kwargs)

    def step(self, closure=None):
        return None


class PerTensorLoopSAM:
    """SAM as the widely used per-tensor implementation computes it, for comparison.

    first_step:  n = || stack(||g_p|| for every p) ||;  for every p: backup_p = clone(p);  p += (rho / (n + 1e-12)) g_p
    second_step: for every p: p.data = backup_p;  then the base optimizer's step

    The base optimizer is built as ``base_optimizer(params, **base_kwargs)`` (by default one that does nothing).
    """

    def __init__(self, params, base_optimizer=NoStep, rho: float = 0.05, **base_kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rho = rho
        self.backups: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.base_optimizer = base_optimizer(self.params, **base_kwargs)

    @torch.no_grad()
    def first_step(self):
        with_grad = [p for p in self.params if p.grad is not None]
        grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in with_grad]), p=2)
        scale = self.rho / (grad_norm + 1e-12)
        for p in with_grad:
            self.backups[p] = p.data.clone()
            p.add_(p.grad * scale)

    @torch.no_grad()
    def second_step(self):
        for p, saved in self.backups.items():
            p.data = saved
        self.backups = {}
        self.base_optimizer.step()

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.backups.values())


PEERS = ("pytorch_optimizer",)  # contenders from another package, each named after the module it imports


def not_installed() -> dict[str, str]:
    """Peer contenders whose package cannot be imported here: name -> the note a run shows in place of their rows."""
    missing = {}
    for name in PEERS:
        try:
            __import__(name)
        except ImportError:
            missing[name] = f"{name} is not installed: its contender is skipped"
    return missing


def available(device: str) -> list[str]:
    """Contenders that can run on ``device`` in this installation."""
    names = ["per-tensor loop"]
    if PEER not in not_installed():
        names += list(PEER_PATHS)
    for name in OURS:
        if name == "triton" and device != "cuda":
            continue  # Triton's interpreter runs on CPU for tests, far too slowly to be timed
        try:
            BACKENDS[name].check_usable({torch.device(device)})
        except ValueError:
            continue
        names.append(name)
    return names


def make(name: str, rule: str, model: torch.nn.Module, partition, rho: float = 0.05):
    """Contender ``name`` running ``rule`` (a key of ``gearsam_fused.OPTIMIZERS``) over ``model``'s parameters."""
    if name == "per-tensor loop":
        return PerTensorLoopSAM(model.parameters(), rho=rho)
    if name in PEER_PATHS:
        import pytorch_optimizer

        return pytorch_optimizer.SAM(model.parameters(), NoStep, rho=rho, foreach=PEER_PATHS[name])
    blocks = {"partition": partition} if OPTIMIZERS[rule] is GEARSAM else {}
    return OPTIMIZERS[rule](model, NoStep, rho=rho, backend=name, **blocks)


def held_bytes(name: str, optimizer) -> int:
    """Bytes the contender holds beyond parameters and gradients while perturbed (after first_step)."""
    if name == "per-tensor loop":
        return optimizer.state_bytes()
    if name in PEER_PATHS:
        return sum(t.nbytes for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))
    return optimizer.memory_overhead()["total"]
