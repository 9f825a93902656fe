"""Running a function on several processes of one process group (127.0.0.1) and collecting what each rank returns: the harness of
the DDP and FSDP2 tests."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 300


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n.startswith("lo")), None)


def _entry(rank: int, port: int, world: int, backend: str, out: str, fn, args: tuple) -> None:
    faulthandler.enable()  # a rank killed by a signal prints where every thread was
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # as the tests' conftest
    loopback = _loopback_interface()
    if loopback is not None:
        # gloo otherwise connects through whatever address the host name resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = fn(rank, *args)
        # free what fn left behind (FSDP2's modules and device meshes hold the process groups in reference cycles)
        # while the runtime is intact, not in the interpreter's finalisation
        gc.collect()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    # The rank's work is done and saved. With torch 2.13, a process that ran gloo collectives sometimes aborts in a C++
    # destructor during interpreter shutdown ("terminate called without an active exception", no Python frame on
    # the stack), after everything above succeeded; leave without running those destructors.
    os._exit(0)


def run_ranks(fn, *args, world: int = 2, backend: str = "gloo") -> list:
    """``[fn(0, *args), ..., fn(world - 1, *args)]``, each run in its own process of one process group on 127.0.0.1
    (``backend`` "gloo", or "nccl" with rank r on GPU r).

    A rank that raises makes this raise ``torch.multiprocessing.ProcessRaisedException`` carrying its traceback; a
    run that outlives ``TIMEOUT_S`` is killed and raises ``TimeoutError``."""
    # the parent owns the rendezvous store on a port the OS picked, so no port can be taken between choice and use
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _entry, args=(store.port, world, backend, out, fn, args), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                    process.join()
                raise TimeoutError(f"{fn.__name__} did not finish on {world} ranks within {TIMEOUT_S} s")
        return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


_ONCE: dict = {}


def run_ranks_once(fn, *args, world: int = 2) -> list:
    """:func:`run_ranks` on gloo, computed on the first call with these arguments and reused by every later one, so
    that one multi-process run serves many tests; its failure fails every caller."""
    key = (fn.__module__, fn.__qualname__, args, world)
    if key not in _ONCE:
        try:
            _ONCE[key] = (True, run_ranks(fn, *args, world=world))
        except Exception as exc:  # noqa: BLE001 - re-raised below, in every test that needs the run
            _ONCE[key] = (False, exc)
    ok, value = _ONCE[key]
    if not ok:
        raise value
    return value


def selected_values(request, param: str) -> set:
    """The values ``param`` takes over the cases of the calling test's module that this run selected (after the
    tiers, ``-k`` and ``--part``): what a multi-process run shared by the module's tests must compute, and no more."""
    values = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is request.module and param in params:
            values.add(params[param])
    return values
