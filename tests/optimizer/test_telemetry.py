"""BlockTelemetry: the same numbers as ``block_stats()``, recorded without reading anything back from the device."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.telemetry import RECORD_FIELDS, BlockTelemetry

from conftest import ALL, SGD_KW, tiny_resnet

# Operations that move data to the host or wait for a value from the device.
HOST_READS = {"aten::_to_copy", "aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero"}


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def sam_steps(opt, model, steps: int, after_first_step=lambda: None, device="cpu"):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 3, 8, 8, generator=g).to(device), torch.randint(0, 3, (4,), generator=g).to(device)
        F.cross_entropy(model(x), y).backward()
        opt.first_step(zero_grad=True)
        after_first_step()
        F.cross_entropy(model(x), y).backward()
        opt.second_step(zero_grad=True)


@pytest.mark.parametrize("backend, device", ALL)
@pytest.mark.parametrize("rule", [SAM, GEARSAM])
def test_records_equal_block_stats_and_arrive_every_n_steps(rule, backend, device):
    model = tiny_resnet(device=device)
    opt = rule(model, torch.optim.SGD, rho=0.1, backend=backend, **SGD_KW)
    batches = []
    telemetry = BlockTelemetry(opt, every=3, sink=batches.append)
    expected = []

    def record():
        telemetry.record()
        expected.append(opt.block_stats())

    sam_steps(opt, model, 7, record, device)
    assert [len(b) for b in batches] == [3, 3]  # the seventh waits in the device buffer
    last = telemetry.flush()
    assert len(batches) == 3 and batches[-1] is last and len(last) == 1 and telemetry.flush() == []
    records = [r for batch in batches for r in batch]
    assert [r["step"] for r in records] == list(range(1, 8))
    for record_, stats in zip(records, expected):
        assert tuple(record_) == RECORD_FIELDS and record_["blocks"] == opt.block_names and record_["rho"] == 0.1
        for key, value in stats.items():
            assert record_[key] == value.tolist(), key  # exact: the same float64 numbers, moved later
    shares = torch.tensor([r["share"] for r in records], dtype=torch.float64).sum(1)
    torch.testing.assert_close(shares, torch.ones(7, dtype=torch.float64), rtol=0, atol=1e-12)


def test_recording_reads_nothing_back_and_a_flush_reads_once():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend="torch", **SGD_KW)
    telemetry = BlockTelemetry(opt, every=4)
    during_record = []

    def record():
        with RecordOps() as ops:
            telemetry.record()
        during_record.append(ops.ops)

    sam_steps(opt, model, 3, record)
    # one write into the buffer's row per step; nothing is read back
    assert during_record == [["aten::stack"]] * 3
    with RecordOps() as ops:
        records = telemetry.flush()
    assert len(records) == 3 and [op for op in ops.ops if op in HOST_READS] == ["aten::_to_copy"]


@pytest.mark.parametrize("backend, device", ALL)
def test_realized_sharpness_comes_from_the_two_losses_without_a_read_back(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, rho=0.1, backend=backend, **SGD_KW)
    telemetry = BlockTelemetry(opt, every=5)
    g = torch.Generator().manual_seed(1)
    losses, host_reads = [], []
    for step in range(4):
        x, y = torch.randn(4, 3, 8, 8, generator=g).to(device), torch.randint(0, 3, (4,), generator=g).to(device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.first_step(zero_grad=True)
        perturbed = F.cross_entropy(model(x), y)
        perturbed.backward()
        opt.second_step(zero_grad=True)
        given = (loss, perturbed) if step != 2 else ()  # a step recorded without its losses
        with RecordOps() as ops:
            telemetry.record(*given)
        host_reads += [op for op in ops.ops if op in HOST_READS]
        losses.append((loss.item(), perturbed.item()) if given else None)
    assert host_reads == []
    for record_, pair in zip(telemetry.flush(), losses):
        if pair is None:
            assert record_["loss"] is record_["perturbed_loss"] is record_["sharpness"] is None
        else:
            assert (record_["loss"], record_["perturbed_loss"]) == pair  # float32 losses, exact in float64
            assert record_["sharpness"] == pair[1] - pair[0]
    with pytest.raises(ValueError, match="pass both loss and perturbed_loss"):
        telemetry.record(loss)


def test_records_continue_the_step_count_and_keep_records_without_a_sink():
    model = tiny_resnet()
    opt = SAM(model, torch.optim.SGD, rho=0.05, backend="reference", **SGD_KW)
    telemetry = BlockTelemetry(opt, every=2, start=40)
    sam_steps(opt, model, 3, telemetry.record)
    telemetry.flush()
    assert [r["step"] for r in telemetry.records] == [41, 42, 43]
    # SAM's implicit score, the root of the energy: within one unit in the last place of the correctly rounded root
    # (torch's vectorised float64 root on the CPU is not always correctly rounded)
    for r in telemetry.records:
        assert all(
            abs(s - math.sqrt(e)) <= math.ulp(math.sqrt(e)) for s, e in zip(r["score"], r["energy"], strict=True)
        )
    assert all(len(r["score"]) == len(opt.block_names) > 1 for r in telemetry.records)


def test_rejects_bad_arguments():
    model = tiny_resnet()
    with pytest.raises(TypeError, match="optimizer must be a gearsam_fused SAM or GEARSAM, got SGD"):
        BlockTelemetry(torch.optim.SGD(model.parameters(), lr=0.1))
    opt = GEARSAM(model, torch.optim.SGD, lr=0.1)
    for every in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="every must be a positive int"):
            BlockTelemetry(opt, every=every)


@pytest.mark.parametrize("backend,device", [case for case in ALL if case.values[1] == "cuda"])
@pytest.mark.parametrize("rule", [SAM, GEARSAM])
def test_no_host_synchronisation_between_flushes_on_cuda(rule, backend, device):
    model = tiny_resnet(device="cuda")
    opt = rule(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    telemetry = BlockTelemetry(opt, every=5)
    sam_steps(opt, model, 1, telemetry.record, "cuda")  # warm-up: first launches may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.zero_grad(set_to_none=False)
        x, y = torch.randn(4, 3, 8, 8, device="cuda"), torch.randint(0, 3, (4,), device="cuda")
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
            opt.first_step()
            telemetry.record()
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            opt.second_step()
            opt.zero_grad(set_to_none=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(telemetry.flush()) == 4
