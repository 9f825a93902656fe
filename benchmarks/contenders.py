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
``compiled foreach SAM``           :class:`CompiledForeachSAM` below: SAM (or GEAR-SAM) in a few lines of
                                   ``torch._foreach_*`` operations, float32 norms, the perturbation one
                                   ``torch.compile``-d function and the restore with the base optimizer's step
                                   another (the whole-step, training-step and models benchmarks; not the
                                   SAM-step one); on CUDA also under ``mode="reduce-overhead"``
``BACKEND, fused base step``       :class:`FusedBaseStep` below: our base optimizer's update alone over the flat
                                   buffers, no SAM (the MomentumSAM benchmark's yardstick)
=================================  ===========================================================================

The peer's best path is not the same on every set and device, so the SAM-step benchmark times both and the report
compares ours with the faster one of the same run.

The per-tensor loop and the peer implement SAM only; ours run both rules (``sam`` and ``gear-sam``). :func:`make`
builds them with a base optimizer that does nothing, so a step measures the SAM machinery alone: energies, allocation,
perturbation and restore. ``bench_whole_step.py`` builds the same implementations around a real base optimizer
(torch's SGD or AdamW).

The SAM family (:data:`FAMILY`, built by :func:`make_variant`): each variant ours (``torch``, ``cpp``, ``triton``) and,
where pytorch_optimizer has it, the peer's on both its paths (the names above), with the same hyperparameters
(:data:`FAMILY_HYPERPARAMETERS`, both libraries' defaults). pytorch_optimizer's GSAM has no ``first_step`` and
``second_step``: :class:`PeerGSAM` drives it as its own ``step()`` does. :func:`family_steps` names what one variant's
rounds step: its rows and the yardsticks their ratios are taken against in the same rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from gearsam_fused import GEARSAM, GSAM, OPTIMIZERS, SAM, WSAM, FriendlySAM, SurrogateGap
from gearsam_fused.allocation import GEAR_RULE, SAM_RULE
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


class CompileTimer:
    """Calls compiled functions and sums the wall time of the calls during which dynamo compiled (a new frame or a
    new graph: the first calls, and each recompile), in :attr:`compile_s`; those calls also ran the function once,
    which is not subtracted. :attr:`cache` counts inductor's FX graph cache hits and misses in those calls: a row with
    misses paid for code generation, one with hits only did not. :attr:`compiling_calls` counts the calls."""

    def __init__(self):
        self.compile_s = 0.0
        self.cache = {"hits": 0, "misses": 0}
        self.compiling_calls = 0

    @staticmethod
    def _counts() -> tuple[int, int, int, int]:
        from torch._dynamo.utils import counters

        # "frames" alone misses the compiles of a fullgraph=True function here (torch 2.13): the graph count sees them
        return (counters["frames"]["total"], counters["stats"]["unique_graphs"],
                counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])  # fmt: skip

    def __call__(self, function, *args, **kwargs):
        (frames, graphs, hits, misses), start = self._counts(), time.perf_counter()
        result = function(*args, **kwargs)
        elapsed = time.perf_counter() - start
        now = self._counts()
        if now[:2] != (frames, graphs):
            self.compile_s += elapsed
            self.compiling_calls += 1
            self.cache["hits"] += now[2] - hits
            self.cache["misses"] += now[3] - misses
        return result


COMPILED = "compiled foreach SAM"
COMPILED_GEAR = "compiled foreach GEAR-SAM"
#: the compiled foreach SAM under ``torch.compile(mode="reduce-overhead")``: inductor captures its steps in CUDA graphs
#: (CUDA only; on a CPU the mode compiles as the default one)
COMPILED_CAPTURED = "compiled foreach SAM, reduce-overhead"


class CompiledForeachSAM:
    """SAM or GEAR-SAM the way a user who wants speed writes it today: a few ``torch._foreach_*`` operations, compiled.

    first_step (one ``torch.compile``-d function):
        n_p   = torch._foreach_norm(g)  per tensor, float32; squared
        SAM:      scale = rho / (sqrt(sum_p n_p^2) + delta)                      one scale for every tensor
        GEAR-SAM: e_b = sum_{p in b} n_p^2;  s <- beta * s + (1 - beta) * e;  t = s / max_b s_b
                  r_b = rho * t_b / ||t||;  scale_b = r_b / (sqrt(e_b) + delta)  (gearsam_fused's GEAR rule)
        backup <- w  (torch._foreach_copy_);  w += scale_b(p) * g  (torch._foreach_mul, torch._foreach_add_)
    second_step (one ``torch.compile``-d function):
        w <- backup  (torch._foreach_copy_), then ``base_optimizer.step()``, as torch's compiled-optimizer tutorial
        compiles ``opt.step`` inside a function; torch's optimizers break the graph before their update (their
        ``_use_grad`` calls ``torch._dynamo.graph_break()``, so that the update compiles as an inference graph), so
        the restore and the update are two graphs of the one function, not one loop

    ``mode``: ``torch.compile``'s mode for both functions; ``"reduce-overhead"`` captures them in CUDA graphs (the
    backups and the EMA are marked static addresses at construction, the gradients at the first step, so that a
    replay reads them where they are instead of copying them in). Every parameter must have a gradient (the
    benchmarks' sets and models give each one).

    ``params_or_blocks``: parameters (one block: what SAM needs) or a list of parameter lists, one per block (what
    GEAR-SAM allocates over; ``[b.params for b in gearsam_fused.partition(model, strategy)]`` gives ours). The base
    optimizer is ``base_optimizer(params, foreach=True, **base_kwargs)``. Hyperparameters stay Python floats, baked
    into the compiled code as constants: nothing here changes them (an LR scheduler would want 0-d tensors instead,
    as torch's compiled-optimizer tutorial says). It does not skip a block whose gradient is not finite, which ours do.
    Its norms are float32, as torch computes them by default: on a tensor of millions of elements a float32 norm is
    about 1e-5 off, relative, which moves the perturbation by that much against gearsam_fused's float64 sums and
    leaves the step within the test suite's float32 tolerance.

    :attr:`compile_s` is the wall time of the calls that compiled (dynamo saw a new frame during the call; the first
    ones, and a recompile when the optimizer's state appears), summed over both functions; those calls also ran the
    step once, which is not subtracted. By default (``reset=True``) constructing one resets dynamo's caches
    (``torch._dynamo.reset()``), so every instance compiles afresh as in a new process, and instances for other models
    do not exhaust the recompile limit of the shared code; a benchmark that steps several compiled contenders in turn
    resets once before building them all and passes ``reset=False`` (a reset would drop the others' compiled code).
    Inductor's on-disk cache still applies, and it decides the cost: compiling a graph it has cached is several times
    faster (SGD over 128 tensors on 2 CPU cores: 48 s cold, 7 s cached). :attr:`compile_cache` counts its hits and
    misses in the compiling calls: a row with misses paid for code generation, one with hits only did not.
    """

    def __init__(self, params_or_blocks, base_optimizer=NoStep, rho: float = 0.05, rule: str = "sam",
                 beta: float = 0.9, delta: float = 1e-12, mode: str | None = None, reset: bool = True,
                 **base_kwargs):  # fmt: skip
        items = list(params_or_blocks)
        blocks = items if items and not isinstance(items[0], torch.Tensor) else [items]
        self.blocks = [b for b in ([p for p in block if p.requires_grad] for block in blocks) if b]
        self.params = [p for block in self.blocks for p in block]
        if rule not in ("sam", "gear-sam"):
            raise ValueError(f"rule must be 'sam' or 'gear-sam', got {rule!r}")
        self.rho, self.rule, self.beta, self.delta = float(rho), rule, float(beta), float(delta)
        self.mode = mode
        device = self.params[0].device
        self.block_of = torch.tensor([b for b, block in enumerate(self.blocks) for _ in block], device=device)
        self.ema = torch.zeros(len(self.blocks), dtype=torch.float32, device=device)
        self.backup = [torch.empty_like(p) for p in self.params]
        self._static = mode == "reduce-overhead"
        if self._static:
            for t in (*self.backup, self.ema):
                torch._dynamo.mark_static_address(t)
        self.base_optimizer = base_optimizer(self.params, foreach=True, **base_kwargs)
        if reset:
            torch._dynamo.reset()
        self._perturb = torch.compile(self._perturb_eager, mode=mode)
        self._restore_and_update = torch.compile(self._restore_and_update_eager, mode=mode)
        self._timer = CompileTimer()

    # not decorated with torch.no_grad: the decorator's wrapper is one code object for every function it decorates
    # (gearsam_fused's steps among them), and dynamo's cache entries for it, made for these functions, then answered a
    # later ``torch.compile`` of another decorated function in the same process, which ran eagerly without compiling.
    # The steps below enter them with gradients off, so that they compile as inference graphs, as the decorator's do.
    def _perturb_eager(self, params, grads, backup, ema):
        energy = torch.stack(torch._foreach_norm(grads)).square()  # float32, per tensor
        if self.rule == "sam":
            eps = torch._foreach_mul(grads, self.rho / (energy.sum().sqrt() + self.delta))
        else:
            energy = torch.zeros_like(ema).index_add_(0, self.block_of, energy)  # per block
            ema.mul_(self.beta).add_(energy, alpha=1.0 - self.beta)
            t = ema / ema.max()
            scale = self.rho * (t / t.norm()) / (energy.sqrt() + self.delta)
            eps = torch._foreach_mul(grads, list(scale[self.block_of].unbind()))
        torch._foreach_copy_(backup, params)
        torch._foreach_add_(params, eps)

    def _restore_and_update_eager(self):
        torch._foreach_copy_(self.params, self.backup)
        self.base_optimizer.step()

    def _timed(self, function, *args):
        """``function(*args)``, its time added to :attr:`compile_s` when dynamo compiled during the call."""
        self._timer(function, *args)

    @property
    def compile_s(self) -> float:
        return self._timer.compile_s

    @property
    def compile_cache(self) -> dict[str, int]:
        return self._timer.cache

    def first_step(self):
        grads = [p.grad for p in self.params]
        if self._static:  # the gradients stay where they are (nothing sets them to None): a replay reads them there
            for g in grads:
                torch._dynamo.mark_static_address(g)
            self._static = False
        with torch.no_grad():
            self._timed(self._perturb, self.params, grads, self.backup, self.ema)

    def second_step(self):
        with torch.no_grad():
            self._timed(self._restore_and_update)

    def zero_grad(self, set_to_none: bool = True):
        self.base_optimizer.zero_grad(set_to_none=set_to_none)


class FusedBaseStep:
    """Our fused base step alone: the base optimizer's update over the flat buffers (the backend's ``update_``: w, g
    and the state read, w and the state written, one pass per bucket), the update a step its schedule skips makes,
    without that step's energy pass. No public call makes this update alone, so :meth:`step` drives the path a skipped
    step takes (the base optimizer's step hooks, the staging of its state and step counts, ``update_``) through the
    optimizer's fused base step (its private ``_flat_step``: ``plan`` and ``run``); one whole SAM step at construction
    makes the optimizer's state. The
    yardstick of a step that adds passes to the base update (:mod:`bench_momentum_step`): the rate our update alone
    reaches at the same moments."""

    def __init__(self, model, base_optimizer, backend: str, rho: float = 0.05, **base_kwargs):
        self.optimizer = SAM(model, base_optimizer, rho=rho, backend=backend, base_step="fused", **base_kwargs)
        self.optimizer.first_step()
        self.optimizer.second_step()

    @torch.no_grad()
    def step(self):
        flat_step = self.optimizer._flat_step
        updates = flat_step.plan()
        if updates is None:
            raise AssertionError(f"the fused base step cannot run: {flat_step.reason}")
        flat_step.run(updates, self.optimizer.backend, perturbed=False)

    @property
    def base_step_mode(self) -> str:
        return self.optimizer.base_step_mode


def two_pass_step(opt, holder, forward_backward):
    """One SAM training step of ``opt`` as a function: ``zero_grad`` of ``holder`` (the model, or the optimizer that
    owns the gradients), forward+backward, ``first_step``, again, ``second_step``. The function's ``optimizer`` is
    ``opt``."""

    def step():
        holder.zero_grad(set_to_none=False)
        forward_backward()
        opt.first_step()
        holder.zero_grad(set_to_none=False)
        forward_backward()
        opt.second_step()

    step.optimizer = opt
    return step


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


# ------------------------------------------------------------------------------ the SAM family

#: the variants' hyperparameters, both libraries' defaults: GSAM's alpha, WSAM's gamma (decoupled, the authors' form),
#: F-SAM's sigma and lmbda
FAMILY_HYPERPARAMETERS = {"alpha": 0.4, "gamma": 0.9, "decouple": True, "sigma": 1.0, "lmbda": 0.9}


class Variant(NamedTuple):
    """A member of the SAM family as the benchmarks run it.

    ``ours(params, base_optimizer, rho, **kwargs)`` builds our optimizer; ``peer`` is the variant of pytorch_optimizer
    whose rows this one is compared with (its own, or for a GEAR-SAM variant, which the peer does not have, the same
    variant under SAM's radius), ``plain`` the variant without the family's part, the yardstick of its machinery;
    ``extra_bytes`` the bytes per float32 parameter its parts move beyond SAM's step, counted from the backend's passes
    over the flat buffers (each pass's reads and writes, no temporaries), ``read_only_bytes`` those of its passes that
    only read (the traffic floor's, benchmarks/conftest.py), and ``folded_bytes`` those that a whole step saves where
    the fused base step takes the descent's mix as it reads the gradients (the kernel backends; the whole step's
    yardstick for every contender, as the fused step's traffic is):

    * GSAM: the perturbation writes g to the kept buffer as it reads it (4; ``keep_gradient_``'s copy, 8, where the
      backend does not fold it); ``block_dot_energy`` reads g and h once for <g, h> and ||h||^2 (8; g's energies are
      the first step's); ``mix_gradient_`` reads h and g and writes the mix (12): 24, 8 of them read-only; folded
      into the base step, the mix is one more read of g (4): 8 fewer
    * WSAM, decoupled: g kept by the perturbation (4); ``exchange_sharpness_`` reads and writes g and h (16);
      ``add_kept_`` after the update reads w and h - g and writes w (12): 32; folded into the base step, which steps
      with g and then takes the sharpness step from the h and g it has read, one more read of g (4): 24 fewer
    * F-SAM: ``friendly_energy_`` reads and writes g and the EMA m and sums the new g's energies as it writes them
      (16; its first step copies g into m, 8, once), in place of SAM's energy pass, which only reads g (4): 12 more,
      and ``read_only_bytes`` -4, as no pass of its step only reads (the two passes of backends other than the kernel
      backends, or of a bucket where a parameter has no gradient: 16 more, 4 of them read-only)
    """

    rule: str
    ours: Callable[..., torch.optim.Optimizer]
    peer: str
    plain: str
    extra_bytes: int = 0
    read_only_bytes: int = 0
    folded_bytes: int = 0


def _gear_sam(params, base_optimizer, rho, **kwargs):
    return GEARSAM(params, base_optimizer, rho=rho, **kwargs)


def _gear_gsam(params, base_optimizer, rho, **kwargs):
    return GEARSAM(params, base_optimizer, rho=rho, descent=SurrogateGap(FAMILY_HYPERPARAMETERS["alpha"]), **kwargs)


def _gsam(params, base_optimizer, rho, **kwargs):
    return GSAM(params, base_optimizer, rho, alpha=FAMILY_HYPERPARAMETERS["alpha"], **kwargs)


def _wsam(params, base_optimizer, rho, **kwargs):
    h = FAMILY_HYPERPARAMETERS
    return WSAM(params, base_optimizer, rho, gamma=h["gamma"], decouple=h["decouple"], **kwargs)


def _friendly_sam(params, base_optimizer, rho, **kwargs):
    h = FAMILY_HYPERPARAMETERS
    return FriendlySAM(params, base_optimizer, rho, sigma=h["sigma"], lmbda=h["lmbda"], **kwargs)


#: name -> the variant; SAM and GEAR-SAM are the yardsticks
FAMILY = {
    "SAM": Variant(SAM_RULE, SAM, peer="SAM", plain="SAM"),
    "GSAM": Variant(SAM_RULE, _gsam, peer="GSAM", plain="SAM", extra_bytes=24, read_only_bytes=8, folded_bytes=8),
    "WSAM": Variant(SAM_RULE, _wsam, peer="WSAM", plain="SAM", extra_bytes=32, folded_bytes=24),
    "F-SAM": Variant(SAM_RULE, _friendly_sam, peer="F-SAM", plain="SAM", extra_bytes=12, read_only_bytes=-4),
    "GEAR-SAM": Variant(GEAR_RULE, _gear_sam, peer="SAM", plain="GEAR-SAM"),
    "GEAR-SAM + GSAM": Variant(
        GEAR_RULE, _gear_gsam, peer="GSAM", plain="GEAR-SAM", extra_bytes=24, read_only_bytes=8, folded_bytes=8
    ),
}
#: our backends a variant runs on (those usable here: triton on CUDA only)
FAMILY_BACKENDS = ("torch", "cpp", "triton")
#: the family's parameter set: a network's shapes (each variant against the peer's and our SAM, not on every set)
FAMILY_SET_KEY = "resnet18"


class ConstantRho:
    """A ``rho_scheduler`` for pytorch_optimizer's GSAM: the same radius at every step."""

    def __init__(self, rho: float):
        self.rho = rho

    def step(self) -> float:
        return self.rho


class PeerGSAM:
    """pytorch_optimizer's GSAM behind ``first_step()`` and ``second_step()``, the calls of its own ``step()`` around
    the second pass: ``perturb_weights(rho)``; then ``gradient_decompose(alpha)``, ``un_perturb()`` and the base
    optimizer's ``step()``. Its base optimizer is an instance, built here as ``base_optimizer(params, **base_kwargs)``."""

    def __init__(self, model, base_optimizer, rho: float, foreach: bool, **base_kwargs):
        import pytorch_optimizer

        base = base_optimizer(model.parameters(), **base_kwargs)
        self.optimizer = pytorch_optimizer.GSAM(model.parameters(), base, model, ConstantRho(rho),
                                                alpha=FAMILY_HYPERPARAMETERS["alpha"], foreach=foreach)  # fmt: skip
        self.state, self.param_groups = self.optimizer.state, self.optimizer.param_groups

    def first_step(self):
        self.optimizer.perturb_weights(self.optimizer.rho_t)

    def second_step(self):
        self.optimizer.gradient_decompose(self.optimizer.alpha)
        self.optimizer.un_perturb()
        self.optimizer.base_optimizer.step()


def _peer_variant(variant: str, model, base_optimizer, rho: float, foreach: bool, **base_kwargs):
    """pytorch_optimizer's ``variant`` (a peer name of :data:`FAMILY`) on the path ``foreach``."""
    import pytorch_optimizer

    h, params = FAMILY_HYPERPARAMETERS, model.parameters()
    if variant == "GSAM":
        return PeerGSAM(model, base_optimizer, rho, foreach, **base_kwargs)
    if variant == "WSAM":
        return pytorch_optimizer.WSAM(model, params, base_optimizer, rho=rho, gamma=h["gamma"], decouple=h["decouple"],
                                      foreach=foreach, **base_kwargs)  # fmt: skip
    if variant == "F-SAM":
        return pytorch_optimizer.FriendlySAM(params, base_optimizer, rho=rho, sigma=h["sigma"], lmbda=h["lmbda"],
                                             foreach=foreach, **base_kwargs)  # fmt: skip
    return pytorch_optimizer.SAM(params, base_optimizer, rho=rho, foreach=foreach, **base_kwargs)


def variant_contenders(device: str) -> list[str]:
    """The contenders of the SAM family that can run on ``device`` here: ours, then the peer's paths."""
    usable = available(device)
    return [name for name in (*FAMILY_BACKENDS, *PEER_PATHS) if name in usable]


def family_skip(variant: str, contender: str, device: str, quick: bool, base: str | None = None) -> str | None:
    """Why ``contender`` has no row for ``variant`` (around the base optimizer named ``base``, if any; None when it has
    one): the peer lacks the variant, or quick mode, a smoke run, runs the family on one of our backends (``cpp``
    where built) and the peer's ``foreach`` path, and the whole step with SGD, only."""
    if contender in PEER_PATHS and FAMILY[variant].peer != variant:
        return f"{contender} has no {variant}"
    in_quick = ("cpp" if "cpp" in available(device) else "torch", PEER)
    if quick and (contender not in in_quick or base not in (None, "SGD")):
        return f"quick mode runs the family with {in_quick} and the whole step with SGD only"
    return None


class FamilySteps(NamedTuple):
    """The steps one variant's rounds take (:func:`family_steps`), each named in ``steps`` with its (variant,
    contender): a contender running the variant by the contender's name (a row), one running another variant as
    ``"VARIANT: contender"`` (a yardstick, which has no row). ``own``: each row's step of its plain variant (SAM, or
    GEAR-SAM for a GEAR-SAM variant; the row itself for those two); ``peer``: the steps of pytorch_optimizer's paths the
    rows are compared with (its variant, or for a GEAR-SAM variant, which the peer does not have, the peer's variant
    under SAM's radius); ``left_out``: the contenders without a row here, and why."""

    steps: dict[str, tuple[str, str]]
    own: dict[str, str]
    peer: tuple[str, ...]
    left_out: dict[str, str]

    @property
    def rows(self) -> list[str]:
        """The contenders with a row, in the order they were added."""
        return list(self.own)


def family_steps(variant: str, device: str, quick: bool, leave_out: dict[str, str],
                 base: str | None = None) -> FamilySteps:  # fmt: skip
    """The steps of ``variant``'s rounds on ``device`` (around the base optimizer named ``base``, if any): each
    contender of :func:`variant_contenders` that has a row (:func:`family_skip`) and is not in ``leave_out`` (name ->
    why), and the yardsticks its ratios need, stepped in the same rounds."""
    v = FAMILY[variant]
    usable = variant_contenders(device)
    steps: dict[str, tuple[str, str]] = {}
    own, left_out = {}, dict(not_installed())

    def add(name: str, contender: str) -> str:
        key = contender if name == variant else f"{name}: {contender}"
        steps[key] = (name, contender)
        return key

    for contender in usable:
        if contender in PEER_PATHS and v.peer != variant:
            continue  # the peer lacks the variant: its own variant is a yardstick below
        reason = leave_out.get(contender) or family_skip(variant, contender, device, quick, base)
        if reason is None:
            row = add(variant, contender)
            own[row] = add(v.plain, contender)
        else:
            left_out[contender] = reason
    peer = tuple(
        add(v.peer, path) for path in PEER_PATHS
        if path in usable and path not in leave_out and family_skip(v.peer, path, device, quick, base) is None
    )  # fmt: skip
    return FamilySteps(steps, own, peer, left_out)


def make_variant(variant: str, name: str, model: torch.nn.Module, partition, base_optimizer=NoStep,
                 rho: float = 0.05, ours: dict | None = None, **base_kwargs):  # fmt: skip
    """Contender ``name`` (of :func:`variant_contenders`) running ``variant`` over ``model``'s parameters around
    ``base_optimizer(params, **base_kwargs)``; ``ours``: further arguments of our optimizer (``base_step=``)."""
    if name in PEER_PATHS:
        return _peer_variant(variant, model, base_optimizer, rho, PEER_PATHS[name], **base_kwargs)
    blocks = {"partition": partition} if FAMILY[variant].rule == GEAR_RULE else {}
    return FAMILY[variant].ours(model, base_optimizer, rho, backend=name, **blocks, **(ours or {}), **base_kwargs)
