"""The base optimizer's step over flat buckets, folded into SAM's restore.

torch's SGD, Adam and AdamW are element-wise: the update of a flat buffer is the update of its pieces. So when the
base optimizer is one of them, ``second_step`` can restore ``w`` and apply the update to a whole bucket in one pass
(:meth:`gearsam_fused.backends.base.Backend.restore_and_update_`) instead of restoring, then stepping tensor by tensor.
The optimizer's state lives in flat buffers laid out like the parameters
(:meth:`gearsam_fused.flat.Bucket.state_buffer`), and every parameter's ``optimizer.state[p]`` holds views of them, so
``state_dict()``, LR schedulers and the optimizer's own ``step()`` see torch's per-parameter state as always.

Anything else takes torch's own step after a plain restore, automatically: other optimizer classes (including
subclasses, which may change the step), flags of the base optimizer whose semantics the flat update does not reproduce
(``fused``, its own ``capturable``, ``differentiable``, hyperparameters that are tensors on a device or need gradients,
except the lr of a step made ``capturable`` by the SAM optimizer, which the kernels read on the device), dtypes other than
float32 and float64 (torch rounds every intermediate to a low-precision parameter's dtype), and steps in which a
parameter has no gradient (torch skips it) or the parameters' states are not all at the same step. The reason is
recorded (:attr:`FlatBaseStep.reason`).

The fused update, stated here once for every kernel that runs it (``csrc/cpu/base_step.cpp``,
``csrc/cuda/base_step.cu``, ``triton_kernels/base_step.py``, each of which says how its device keeps these roundings).
It reads ``w`` from the backup and writes the parameter and the state; C is the buffers' dtype (float32 or float64),
``C(x)`` a host scalar rounded once to C, ``fma`` a single rounding, and every other operation rounds on its own::

    both:  g = fma(C(c[block]), correction, C(a[block]) * grad) if correction   (c = correction_scale; a =
           grad_scale, or no product where it is not given: LookSAM's correction; with it, the SAM family's mix)
    sgd:   g = ±g (- if maximize);  g = fma(C(weight_decay), w, g) if weight_decay != 0
           b = g (first step) or fma(C(1 - dampening), g, buf * C(momentum));  buf = b      if momentum != 0
           d = fma(C(momentum), b, g) if nesterov else b (momentum) or g (no momentum)
           w <- fma(C(-lr), d, w)
    adam:  g = ±g;  if weight_decay != 0: w = w * C(decay) (AdamW) or g = fma(C(weight_decay), w, g) (Adam)
           m = lerp(m, g, C(1 - beta1));  v = fma(C(1 - beta2) * g, g, v * C(beta2))
           vmax = max(vmax, v) (amsgrad);  denom = sqrt(vmax or v) / C(bias_correction2_sqrt) + C(eps)
           w <- w + (C(-step_size) * m) / denom

with ``step_size``, ``bias_correction2_sqrt`` and ``decay`` from :func:`adam_scalars`. These are the roundings of
ATen's CPU kernels behind ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` with ``foreach=False`` (``add(alpha=s)`` is one
fma, ``lerp`` is one fma on either side of weight 1/2, ``addcmul`` rounds ``value * t1`` before its fma, the
division by ``bias_correction2_sqrt`` is a true division), so the fused step gives the bits of a restore followed by
torch's step, with one exception: the square root. Every kernel (C++ CPU and CUDA, Triton) takes the correctly
rounded root; torch's CPU ``sqrt`` on x86 builds is MKL's, which misses it by one unit in the last place for about one
float32 root in six (one float64 root in seventy), moving that element's update by about one part in 1e7 (float32).
So on the CPU the ``cpp`` backend's Adam equals torch's Adam taken with the correctly rounded root bit for bit, and
torch's own within that unit; the ``torch`` backend runs torch's own operations, root included, and equals it bit for
bit.

The state is checked once and then trusted, as torch's optimizers trust theirs: once a bucket's state tensors are
views of its flat buffers (:meth:`FlatBaseStep.adopted`), later steps do not look at them again until something that
can change them happens: ``load_state_dict`` (:meth:`FlatBaseStep.adopt`), a step of the base optimizer's own
(:meth:`FlatBaseStep.invalidate`), a new ``optimizer.state`` or a change in its number of entries (which every bucket
checks again, not only the one that notices it), or new state keys (momentum switched on; ``amsgrad`` switched on
after the first steps leaves state torch's own step cannot read, which is declined). A state tensor replaced by hand
is not taken in by the step then; ``state_dict()`` refuses to save it, and :func:`set_state_debug_mode` makes every
step check and take it in.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from .compat import graph_may_break, step_post_hooks, step_pre_hooks
from .compiled import mark_stepped_now
from .flat import Bucket, FlatLayout

#: The mode names of ``opt.base_step_mode``, and with "auto" the values of the optimizers' ``base_step`` argument.
FUSED, PER_TENSOR = "fused", "per-tensor"
BASE_STEPS = ("auto", FUSED, PER_TENSOR)
#: The torch optimizers whose step is fused, by the update they run (exact classes: a subclass may change the step).
FUSED_OPTIMIZERS: dict[type, str] = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
_FLOAT_DTYPES = (torch.float32, torch.float64)
# Flags whose semantics the flat update does not reproduce, and why.
_UNFUSED_FLAGS = {
    "fused": "fused=True asks for torch's own fused kernel",
    "capturable": "capturable=True keeps the step count on the device (for CUDA graphs)",
    "differentiable": "differentiable=True needs autograd through the update",
}


_state_debug_mode = False


def set_state_debug_mode(enabled: bool) -> None:
    """Check, at every step, that every parameter's optimizer state is still a view of the fused base step's flat
    buffers, and take in any state tensor replaced by hand (copying it into the buffers), instead of trusting the
    state once it was taken in. A debugging aid, as ``torch.autograd.set_detect_anomaly`` is: the check costs a few
    Python operations per parameter and step. Off by default."""
    global _state_debug_mode
    if not isinstance(enabled, bool):
        raise TypeError(f"set_state_debug_mode takes True or False, got {enabled!r}")
    _state_debug_mode = enabled


def get_state_debug_mode() -> bool:
    """Whether :func:`set_state_debug_mode` is on."""
    return _state_debug_mode


class StateOrigin(enum.Enum):
    """Where a bucket's optimizer state came from when :meth:`FlatBaseStep._adopt` made it views of the flat
    buffers (None where it could not)."""

    CREATED = "created"  #: no parameter had state yet: zeroed views are installed (the first step)
    EXISTING = "existing"  #: every parameter had state: it is now (or already was) a view of the flat buffers


@dataclass
class BucketUpdate:
    """One bucket's share of a fused base step: the update ``kind`` (``"sgd"`` or ``"adam"``), the group's
    hyperparameters as Python numbers (``hyper``), the flat state buffers in the kernels' argument order (None for an
    unused one), and ``step``: Adam's step count after this update (1 for the first); SGD's is 1 when its momentum
    buffer starts from this step's gradient, else 2. A capturable step (``scalars`` given) has them on the device:
    ``hyper["lr"]`` is the group's lr tensor, ``step`` is None, and the kernels read ``(lr, step)`` from ``scalars``
    (float64 ``[2]``, written by :meth:`FlatBaseStep.run`)."""

    bucket: Bucket
    kind: str
    hyper: dict
    state: list[torch.Tensor | None]
    step: int | None
    scalars: torch.Tensor | None = None
    #: planned from the bucket alone in a step compiled whole (:meth:`FlatBaseStep.why_not_ready`), whose checks the
    #: compiled code makes when it runs
    checked_when_run: bool = False
    #: the plan created the bucket's state (zeroed views of its buffers): taken back where a later bucket declines
    created: bool = False

    def kernel_arguments(self) -> dict:
        """The keyword arguments of the kernel modules' ``sgd_step_``/``adam_step_`` (besides ``tile``): the group's
        hyperparameters and SGD's first-step flag or Adam's step count (see :func:`adam_scalars`), or, capturable,
        ``scalars`` with the host values they replace at 0."""
        h = self.hyper
        if self.kind == "sgd":
            names = ("weight_decay", "momentum", "dampening", "nesterov", "maximize")
            when = {"lr": h["lr"], "first": self.step == 1} if self.scalars is None else {"lr": 0.0, "first": False}
        else:
            beta1, beta2 = h["betas"]
            h = {**h, "beta1": beta1, "beta2": beta2, "decoupled": h["decoupled_weight_decay"]}
            names = ("beta1", "beta2", "eps", "weight_decay", "decoupled", "amsgrad", "maximize")
            when = {"lr": h["lr"], "step": self.step} if self.scalars is None else {"lr": 0.0, "step": 0}
        if self.scalars is not None:
            when["scalars"] = self.scalars
        return {**{k: h[k] for k in names}, **when}


def adam_scalars(lr: float, beta1: float, beta2: float, weight_decay: float, step: int) -> tuple[float, float, float]:
    """``(step_size, bias_correction2_sqrt, decay)`` of Adam's ``step``-th update, in float64 as torch's Adam computes
    them in Python: ``lr / (1 - beta1**k)``, ``(1 - beta2**k) ** 0.5`` and ``1 - lr * weight_decay`` (AdamW's), with
    ``k`` the step count as a float. The kernels take ``lr`` and ``step`` and derive these themselves (the Triton
    launcher by this function, ``csrc/library.cpp`` by the same operations in C++), so that a compiled step passes
    the step count, which the compiler keeps symbolic, rather than floats it would specialise on."""
    k = float(step)
    return lr / (1 - beta1**k), (1 - beta2**k) ** 0.5, 1 - lr * weight_decay


def _plain(value):
    """``value`` as a Python number, or None when it is a tensor whose value cannot be read for free (on a device,
    or needing gradients)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad or value.device.type != "cpu" or value.numel() != 1:
            return None
        return value.item()
    return value


def _rounded_tensor(value) -> str:
    """The dtype of a tensor in ``value`` (a hyperparameter, or a tuple of them) narrower than float64, "" if none."""
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, torch.Tensor) and v.dtype != torch.float64:
            return str(v.dtype).removeprefix("torch.")
    return ""


class FlatBaseStep:
    """Steps ``optimizer`` (one of :data:`FUSED_OPTIMIZERS`) over the buckets of ``layout``.

    Each step, :meth:`plan` checks what the flat update needs and gives one :class:`BucketUpdate` per bucket, or None
    after setting :attr:`reason`; :meth:`run` then runs the update as the base optimizer's ``step()`` would, between
    its hooks, and advances the step counts.

    ``capturable``: every bucket keeps its step count on its device (SGD's too: it says which step starts the momentum
    buffer) and a float64 ``[2]`` of ``(lr, step)`` the kernels read, so that no step reads a value on the host and a
    CUDA graph replays it with the current lr; the groups' ``lr`` are tensors on the device. :meth:`run` writes them
    before the update, and takes back the count of a step that ``found_inf`` skipped.

    ``key``: the registry key of the sharpness-aware optimizer this step belongs to
    (:func:`~gearsam_fused.compiled.register`), by which a step compiled whole checks, when it runs, what it planned
    from the buckets alone (:func:`~gearsam_fused.compiled.check_ready_`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: FlatLayout, capturable: bool = False,
                 key: int | None = None):  # fmt: skip
        self.optimizer = optimizer
        self.key = key
        self.kind = FUSED_OPTIMIZERS[type(optimizer)]
        self.layout = layout
        self.capturable = capturable
        #: why the last :meth:`plan` declined ("" when it did not)
        self.reason = ""
        #: replaced where the state may have changed behind a compiled step's back (:meth:`adopt`,
        #: :meth:`invalidate`): a trace that planned buckets as ready is guarded on it
        self.epoch = _Epoch()
        self._adopted: dict[int, tuple[str, ...]] = {}  # id(bucket) -> the state keys adopted (see adopted())
        self._state_seen: tuple[object, int] | None = None  # optimizer.state and its size when last adopted
        self._scalars: dict[int, torch.Tensor] = {}  # id(bucket) -> (lr, step), capturable
        self._reserve()

    def _reserve(self) -> None:
        """Allocate the flat state buffers (and Adam's count vector) the groups' options call for, as the first step
        would: a step compiled with ``torch.compile`` finds them in place (a trace cannot create them; see
        :meth:`~gearsam_fused.flat.Bucket.state_buffer`). The optimizer's per-parameter state stays empty until then."""
        for bucket in self.layout.buckets:
            keys = self._group_keys(bucket)
            if self.kind == "adam" or self.capturable:
                bucket.step_counts(_step_dtype(), on_device=self.capturable)
            if self.capturable:
                self._scalars[id(bucket)] = torch.zeros(2, dtype=torch.float64, device=bucket.device)
            for key in keys:
                bucket.state_buffer(key)

    @staticmethod
    def why_not(optimizer: torch.optim.Optimizer) -> str:
        """Why ``optimizer`` can never be fused ("" when it can be)."""
        if type(optimizer) not in FUSED_OPTIMIZERS:
            covered = ", ".join(cls.__name__ for cls in FUSED_OPTIMIZERS)
            return f"the fused base step covers torch's {covered}; {type(optimizer).__name__} steps per tensor"
        return ""

    def plan(self) -> list[BucketUpdate] | None:
        """This step's update of every bucket, or None (the base optimizer's own step) with :attr:`reason` set."""
        self.layout.sync()  # the second backward may have made new gradient tensors: the update reads the buffers
        updates = []
        for index, bucket in enumerate(self.layout.buckets):
            if bucket.n_tiles == 0:
                continue
            update = self._plan_bucket(bucket, index)
            if update is None:
                self._take_back(updates)
                return None
            updates.append(update)
        self.reason = ""
        ready = [update.bucket.grad for update in updates if update.checked_when_run]
        if ready:  # planned from the buckets alone by a step compiled whole: checked when the compiled code runs
            torch.ops.gearsam_fused.check_ready_(ready, self.key)
        return updates

    def run(self, updates: list[BucketUpdate], backend, *, perturbed: bool = True, correction=None, found_inf=None,
            mix=None, momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        """The planned update, run as the base optimizer's ``step()`` would run it: between its step hooks (a
        pre-hook may hand the step a closure, which runs first; the update is then planned again), ``backend``'s
        ``restore_and_update_`` (``perturbed``: from the saved ``w``; ``found_inf``, ``mix``) or ``update_`` of the
        current weights (``correction``), then the step counts recorded and the base optimizer marked as stepped (an
        LR scheduler may be attached to it). Returns the new momentum's block energies with ``momentum_energy``
        (:meth:`~gearsam_fused.backends.base.Backend.restore_and_update_`). Where a hook or the closure fails, ``w``,
        not ``w + eps``, is left in the model, as when torch's own ``step()`` fails."""
        try:
            args, kwargs = run_pre_hooks(self.optimizer)
            closure = step_closure(self.optimizer, args, kwargs)
            if closure is not None:
                with torch.enable_grad():
                    closure()
                updates = self.plan()  # the closure may have changed the gradients
                if updates is None:
                    raise RuntimeError(f"the base step cannot run after a step pre-hook's closure: {self.reason}")
        except BaseException:
            backend.restore_()
            raise
        self._advance_device_counts(updates)
        if perturbed:
            energy = backend.restore_and_update_(updates, found_inf, mix, momentum_energy)
        else:
            energy = backend.update_(updates, correction, momentum_energy)
        self._record_step(updates, found_inf)
        mark_stepped_now(self.optimizer)
        run_post_hooks(self.optimizer, args, kwargs)
        return energy

    def adopt(self) -> None:
        """Take loaded state into the flat buffers now (``load_state_dict`` calls this) rather than at the next step:
        a step compiled with ``torch.compile`` cannot read the loaded step counts. Buckets whose parameters have no
        state yet, or that the next :meth:`plan` would decline, are left to it."""
        self.invalidate()  # the loaded state may be no state at all: a compiled step plans its buckets again
        state = self.optimizer.state
        for bucket in self.layout.buckets:
            if bucket.dtype not in _FLOAT_DTYPES or not any(state.get(slot.param) for slot in bucket.slots):
                continue
            hyper = self._hyper(self.optimizer.param_groups[bucket.group], bucket.group)
            if hyper is None:
                continue
            origin = self._adopt(bucket, self._state_keys(hyper))
            if origin is StateOrigin.EXISTING and self.kind == "adam":
                self._adopt_counts(bucket, created=False)
            elif origin is not None and self.capturable:  # SGD: the loaded momentum buffers start no more
                bucket.step_counts(_step_dtype())[0].fill_(0 if origin is StateOrigin.CREATED else 1)
        self.reason = ""

    def _advance_device_counts(self, updates: list[BucketUpdate]) -> None:
        """Capturable: advance every bucket's step count on the device and write ``(lr, step)`` where the kernels
        read them (device operations only). Nothing without ``capturable``."""
        for update in updates:
            if update.scalars is not None:
                counts = update.bucket.step_counts(_step_dtype())[0]
                counts.add_(1)
                update.scalars[:1].copy_(update.hyper["lr"])
                update.scalars[1:].copy_(counts[:1])

    def _record_step(self, updates: list[BucketUpdate], found_inf: torch.Tensor | None = None) -> None:
        """Record the step: advance Adam's per-parameter step counts (one operation per bucket); capturable, where
        :meth:`_advance_device_counts` advanced them, take the count back where ``found_inf`` (0 or 1 on the device)
        skipped the step, as torch's fused optimizers do."""
        for update in updates:
            if update.scalars is not None:
                if found_inf is not None:
                    update.bucket.step_counts(_step_dtype())[0].sub_(found_inf)
            elif update.kind == "adam":
                update.bucket.step_counts(_step_dtype())[0].add_(1)
                update.bucket.counted = update.step

    def _take_back(self, updates: list[BucketUpdate]) -> None:
        """Remove the state a declined plan created for its earlier buckets: torch's own step, which runs instead,
        starts a state it finds missing from the gradient (SGD's momentum buffer without dampening), not from the
        zeros the plan wrote."""
        state = self.optimizer.state
        for update in updates:
            if not update.created:
                continue
            keys = self._state_keys(update.hyper) + (["step"] if update.kind == "adam" else [])
            for slot in update.bucket.slots:
                entry = state.get(slot.param)
                if entry is None:
                    continue
                for key in keys:
                    entry.pop(key, None)
                if not entry:
                    del state[slot.param]
            update.bucket.counted = None
        if any(update.created for update in updates):
            self.invalidate()

    def _decline(self, reason: str) -> None:
        self.reason = reason
        return None

    def _plan_bucket(self, bucket: Bucket, index: int) -> BucketUpdate | None:
        group = self.optimizer.param_groups[bucket.group]
        if bucket.dtype not in _FLOAT_DTYPES:
            dtype = str(bucket.dtype).removeprefix("torch.")
            return self._decline(f"{dtype} parameters: torch's optimizer rounds every intermediate to {dtype}")
        hyper = self._hyper(group, bucket.group)
        if hyper is None:
            return None
        keys = self._state_keys(hyper)
        # A step compiled whole (fullgraph=True, where a declined plan could not run anyway) plans a bucket it finds
        # ready from the bucket alone, so that dynamo guards on no parameter's gradient or state: evaluating those
        # guards took longer per call than the step's own work on small tensors. The compiled code makes the checks
        # when it runs (compiled.check_ready_).
        ready = torch.compiler.is_compiling() and not graph_may_break() and _ready_when_traced(self, index, self.epoch)
        if not ready:
            # eagerly, plan's sync has just looked at every gradient; a trace looks at them itself
            reason = self._missing_gradient(bucket, synced=not torch.compiler.is_compiling())
            if reason:
                return self._decline(reason)
        # a trace that may break plans as an eager step without trust, as it always traced the checks
        adopted = ready or (not torch.compiler.is_compiling() and self.adopted(bucket, keys))
        origin = StateOrigin.EXISTING if adopted else self._adopt(bucket, keys)
        if origin is None:
            return None
        scalars = self._scalars.get(id(bucket))
        if self.kind == "sgd":
            first = origin is StateOrigin.CREATED
            if first and scalars is not None:
                bucket.step_counts(_step_dtype())[0].zero_()  # the device decides the first step from the count
            state = [bucket.state_buffer(keys[0])[0]] if keys else [None]
            step = None if scalars is not None else 1 if first else 2
        else:
            counts = self._adopt_counts(bucket, created=origin is StateOrigin.CREATED, adopted=adopted)
            if counts is None:
                return None
            state = [bucket.state_buffer(k)[0] for k in keys] + ([] if hyper["amsgrad"] else [None])
            step = None if scalars is not None else counts + 1
        if not adopted and not torch.compiler.is_compiling():
            self._trust(bucket, keys)
        return BucketUpdate(bucket, self.kind, hyper, state, step, scalars, ready, origin is StateOrigin.CREATED)

    def adopted(self, bucket: Bucket, keys: list[str]) -> bool:
        """Whether ``bucket``'s state of ``keys`` (and Adam's step counts) was made views of its flat buffers and
        nothing that can change it has happened since: the step then trusts it without looking (never under
        :func:`set_state_debug_mode`)."""
        state = self.optimizer.state
        seen = self._state_seen
        if seen is None or seen[0] is not state or seen[1] != len(state):
            # every bucket's, not only this one's: the bucket that notices records the new state as seen
            self._adopted.clear()
            return False
        return not _state_debug_mode and self._adopted.get(id(bucket)) == tuple(keys)

    def _trust(self, bucket: Bucket, keys: list[str]) -> None:
        """Record ``bucket``'s state of ``keys`` as adopted (see :meth:`adopted`)."""
        self._adopted[id(bucket)] = tuple(keys)
        self._state_seen = self.optimizer.state, len(self.optimizer.state)

    def why_not_ready(self, bucket: Bucket, synced: bool = False) -> str:
        """Why ``bucket``'s update cannot be planned from the bucket alone ("" when it can): a parameter without a
        gradient, a state tensor that is not a view of the bucket's buffers (before the first step, or replaced by
        hand), Adam's step counts not the bucket's views or, without ``capturable``, not known to the host.
        ``synced``: the layout's sync has just looked at every gradient
        (:attr:`~gearsam_fused.flat.Bucket.missing_grad`). Adopted state (:meth:`adopted`) is trusted."""
        reason = self._missing_gradient(bucket, synced)
        if reason:
            return reason
        keys = self._group_keys(bucket)
        counts_known = self.kind != "adam" or (
            bucket.counts is not None and (self.capturable or bucket.counted is not None)
        )
        if self.adopted(bucket, keys) and counts_known:
            return ""
        views = {key: bucket.state_views.get(key) for key in keys}
        if self.kind == "adam":
            views["step"] = bucket.step_counts(_step_dtype())[1] if counts_known else None
        name = self._foreign_state(bucket, views)
        if name:
            return f"the optimizer state of parameter {name!r} is not the one the last step left"
        self._trust(bucket, keys)
        return ""

    def check_state(self) -> None:
        """Refuse state that was replaced by hand in a bucket whose state the step trusts (:meth:`adopted`): the steps
        since did not read it. ``state_dict()`` calls this before saving."""
        for bucket in self.layout.buckets:
            keys = self._adopted.get(id(bucket))
            if keys is None:
                continue
            views = {key: bucket.state_views[key] for key in keys}
            if self.kind == "adam" and bucket.counts is not None:
                views["step"] = bucket.step_counts(_step_dtype())[1]
            name = self._foreign_state(bucket, views) if views else None  # no state to replace: SGD without momentum
            if name:
                raise RuntimeError(
                    f"the optimizer state of parameter {name!r} was replaced since the fused base step took it in, "
                    "other than through load_state_dict, and the steps since did not read it. Change the optimizer "
                    "state through load_state_dict, or call gearsam_fused.set_state_debug_mode(True) to have every "
                    "step take in state replaced by hand"
                )

    def invalidate(self) -> None:
        """Forget what was adopted (the next step checks the state again) and make compiled code that planned buckets
        as ready plan them again at its next call: the state may have changed (a load, the base optimizer's own
        step)."""
        self.epoch = _Epoch()
        self._adopted.clear()

    @staticmethod
    def _missing_gradient(bucket: Bucket, synced: bool = False) -> str:
        """Why ``bucket`` cannot be updated for a missing gradient ("" when every parameter has one). ``synced``: the
        layout's sync has just looked at every gradient, and what it found
        (:attr:`~gearsam_fused.flat.Bucket.missing_grad`) is the answer."""
        if synced:
            return _no_gradient(bucket.missing_grad)
        return _no_gradient(next((slot.name for slot in bucket.slots if slot.param.grad is None), None))

    def _entries(self, bucket: Bucket) -> list[dict | None]:
        """Each of ``bucket``'s parameters' state entry, None where it has none."""
        state = self.optimizer.state
        return [state.get(slot.param) for slot in bucket.slots]

    def _foreign_state(self, bucket: Bucket, views: dict[str, list[torch.Tensor] | None],
                       entries: list[dict | None] | None = None) -> str | None:  # fmt: skip
        """The name of the first parameter of ``bucket`` whose state tensor of a key of ``views`` is not its view
        there (every parameter's, where the views are None), None when there is none."""
        entries = self._entries(bucket) if entries is None else entries
        for i, (slot, entry) in enumerate(zip(bucket.slots, entries)):
            if entry is None or any(vs is None or entry.get(key) is not vs[i] for key, vs in views.items()):
                return slot.name
        return None

    def _hyper(self, group: dict, index: int) -> dict | None:
        for flag, why in _UNFUSED_FLAGS.items():
            # torch.compile's trace shows every group of a torch optimizer with capturable=True (it would make the
            # optimizer's own step capturable on a GPU), so a trace reads the flag from the optimizer's defaults
            traced = flag == "capturable" and torch.compiler.is_compiling()
            if (self.optimizer.defaults if traced else group).get(flag):
                return self._decline(f"param group {index}: {why}")
        if self.kind == "sgd":
            names = ("lr", "weight_decay", "momentum", "dampening", "nesterov", "maximize")
        else:
            names = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
        hyper = {}
        for name in names:
            value = group[name]
            if name == "lr" and self.capturable:  # the optimizer checked it is a tensor on the device
                hyper[name] = value
                continue
            if self.kind == "adam" and _rounded_tensor(value):
                return self._decline(
                    f"param group {index}: {name} holds a {_rounded_tensor(value)} tensor, in whose precision "
                    "torch's Adam rounds what it computes from it; a float or a float64 tensor is fused"
                )
            value = tuple(_plain(v) for v in value) if name == "betas" else _plain(value)
            if value is None or (isinstance(value, tuple) and None in value):
                return self._decline(
                    f"param group {index}: {name} is a tensor that needs gradients or lives on a device, so the "
                    "update cannot read it without a synchronisation"
                )
            hyper[name] = value
        if self.kind == "adam":
            hyper["decoupled_weight_decay"] = bool(
                group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
            )
        return hyper

    def _group_keys(self, bucket: Bucket) -> list[str]:
        """:meth:`_state_keys` of the options of ``bucket``'s param group."""
        group = self.optimizer.param_groups[bucket.group]
        if self.kind == "sgd":
            return self._state_keys({"momentum": group["momentum"]})
        return self._state_keys({"amsgrad": group["amsgrad"]})

    def _state_keys(self, hyper: dict) -> list[str]:
        if self.kind == "sgd":
            return ["momentum_buffer"] if hyper["momentum"] != 0 else []
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hyper["amsgrad"] else [])

    def _adopt(self, bucket: Bucket, keys: list[str]) -> StateOrigin | None:
        """Make every parameter's state tensors views of the bucket's flat buffers (copying in any state that was
        replaced, e.g. by ``load_state_dict``). None, with :attr:`reason` set, where only some parameters have
        state."""
        views = {key: bucket.state_buffer(key)[1] for key in keys}
        entries = self._entries(bucket)
        if self._foreign_state(bucket, views, entries) is None:
            return StateOrigin.EXISTING
        have = [bool(e) and all(e.get(k) is not None for k in keys) for e in entries]
        if not keys:
            return StateOrigin.EXISTING if any(have) else StateOrigin.CREATED
        for slot, entry, complete in zip(bucket.slots, entries, have):
            if entry and not complete:  # torch's own step fails on it, as it does without us
                missing = next(k for k in keys if entry.get(k) is None)
                return self._decline(
                    f"param group {bucket.group}: parameter {slot.name!r} has optimizer state without {missing!r} "
                    "(an option switched on after its first step, e.g. amsgrad)"
                )
        if any(have) and not all(have):
            return self._decline(
                f"param group {bucket.group}: some parameters have optimizer state and others none (some were "
                "stepped without the others)"
            )
        created = not have[0]
        state = self.optimizer.state
        for i, slot in enumerate(bucket.slots):
            entry = state[slot.param]
            for key, slot_views in views.items():
                view, current = slot_views[i], entry.get(key)
                if current is not view:
                    view.zero_() if created else view.copy_(current)
                    entry[key] = view
        return StateOrigin.CREATED if created else StateOrigin.EXISTING

    def _adopt_counts(self, bucket: Bucket, created: bool, adopted: bool = False) -> int | None:
        """Adam's step count, the same for every parameter of the bucket (declined otherwise), after making each
        ``state[p]["step"]`` a view of the bucket's CPU count vector (``adopted``: they are known to be)."""
        counts, views = bucket.step_counts(_step_dtype())
        ours = adopted or (not created and self._foreign_state(bucket, {"step": views}) is None)
        if ours and self.capturable:
            return 0  # the kernels read the count on the device; the host does not know it
        if ours and bucket.counted is not None and torch.compiler.is_compiling():
            return bucket.counted  # a trace cannot read the vector; the compiled sync checks it (flat.sync_)
        if created:
            counts.zero_()
        if not ours:
            state = self.optimizer.state
            for slot, view in zip(bucket.slots, views):
                entry = state[slot.param]
                current = entry.get("step")
                if current is not view:
                    if current is not None and not created:
                        view.copy_(current)
                    # first in the entry, as torch's Adam orders its state (and so its state dicts)
                    rest = {k: entry.pop(k) for k in list(entry) if k != "step"}
                    entry.pop("step", None)
                    entry.update(step=view, **rest)
        if created:
            bucket.counted = None if self.capturable else 0
            return 0
        low, high = counts.aminmax()
        if low != high:
            return self._decline(
                f"param group {bucket.group}: its parameters are at different Adam steps ({int(low)} to {int(high)})"
            )
        value = float(low)
        if not math.isfinite(value) or value != int(value):
            return self._decline(f"param group {bucket.group}: step count {value} is not a whole number")
        bucket.counted = None if self.capturable else int(value)
        return int(value)


def _step_dtype() -> torch.dtype:
    # torch's Adam keeps its CPU step counts in float64 when that is the default dtype, else float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def run_pre_hooks(optimizer: torch.optim.Optimizer) -> tuple[tuple, dict]:
    """Call the hooks torch calls before ``optimizer.step()`` (the global ones, then the optimizer's), as torch calls
    them: with the step's ``(args, kwargs)``, which a hook may replace by returning a new pair; any other return but
    None is an error. Returns the pair the step is to run with. A fused base step does not call ``step()``, and a
    user's hook must still run."""
    args, kwargs = (optimizer,), {}
    for hook in step_pre_hooks(optimizer):
        result = hook(optimizer, args, kwargs)
        if result is None:
            continue
        if not (isinstance(result, tuple) and len(result) == 2):
            raise RuntimeError(
                f"optimizer step pre-hook {hook!r} must return None or a tuple of (new_args, new_kwargs), got {result!r}"
            )
        args, kwargs = result
    return args, kwargs


def step_closure(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict):
    """The closure of ``step(closure=None)`` called with ``args`` and ``kwargs`` (None when there is none), refused
    as that call would refuse them."""
    extra = list(args[1:])
    if len(extra) > 1 or set(kwargs) - {"closure"} or (extra and "closure" in kwargs):
        raise TypeError(
            f"{type(optimizer).__name__}.step() takes only a closure; a step pre-hook passed it the arguments "
            f"{tuple(extra)!r} and {kwargs!r}"
        )
    return extra[0] if extra else kwargs.get("closure")


def run_post_hooks(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Call the hooks torch calls after ``optimizer.step()`` (the optimizer's, then the global ones) with the step's
    ``(args, kwargs)``."""
    for hook in step_post_hooks(optimizer):
        hook(optimizer, args, kwargs)


def _no_gradient(name: str | None) -> str:
    return f"parameter {name!r} has no gradient: torch's optimizer skips it this step" if name is not None else ""


class _Epoch:
    """:attr:`FlatBaseStep.epoch`: an object whose identity a compiled step is guarded on."""


@torch.compiler.assume_constant_result
def _ready_when_traced(step: FlatBaseStep, index: int, epoch: _Epoch) -> bool:
    """Whether bucket ``index`` of ``step`` is ready (:meth:`FlatBaseStep.why_not_ready`), asked while dynamo traces a
    step and answered by running for real: a constant of the graph, under guards on ``step`` and ``epoch`` alone."""
    return not step.why_not_ready(step.layout.buckets[index])
