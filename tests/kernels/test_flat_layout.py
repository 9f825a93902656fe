"""The flat layout: what it does to the model (nothing visible), its geometry, and keeping the views honest."""

import copy
import os

import pytest
import torch
from torch import nn

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.flat import ALIGN, TILE
from gearsam_fused.memory import HUGE_PAGE, advise_huge_pages, huge_page_range, huge_page_setting

from conftest import FUSED, SGD_KW, NoStep, batches, loss_fn, on_device, tiny_resnet


def _buckets(opt):
    return opt.backend.layout.buckets


def _in_buffer(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= t.data_ptr() < start + buffer.nbytes


@pytest.mark.parametrize("backend,device", FUSED)
def test_model_is_untouched_from_the_outside(backend, device):
    model = tiny_resnet(device=device)
    twin = copy.deepcopy(model)
    params_before = list(model.parameters())
    GEARSAM(model, torch.optim.SGD, backend=backend, **SGD_KW)
    assert all(a is b for a, b in zip(model.parameters(), params_before))  # same Parameter objects
    ours, theirs = model.state_dict(), twin.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].stride() == theirs[k].stride() for k in ours)
    x, _ = batches(1, device=device)[0]
    assert torch.equal(model(x), twin(x))


@pytest.mark.parametrize("backend,device", FUSED)
@pytest.mark.parametrize("strategy", ["coarse", "fine", "tensor"])
def test_geometry_blocks_contiguous_tensors_aligned_tiles_in_one_block(backend, device, strategy):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, partition=strategy, backend=backend, **SGD_KW)
    (bucket,) = _buckets(opt)
    assert bucket.numel % TILE == 0 and bucket.n_tiles == bucket.numel // TILE
    first_tile_of_block = bucket.first_tile_of_block.tolist()
    block_of_tile = bucket.block_of_tile.tolist()
    assert (
        len(first_tile_of_block) == len(opt.blocks) + 1
        and first_tile_of_block[0] == 0
        and first_tile_of_block[-1] == bucket.n_tiles
    )
    for b, block in enumerate(opt.blocks):
        lo, hi = first_tile_of_block[b] * TILE, first_tile_of_block[b + 1] * TILE
        assert block_of_tile[first_tile_of_block[b] : first_tile_of_block[b + 1]] == [b] * (
            first_tile_of_block[b + 1] - first_tile_of_block[b]
        )
        for p in block.params:
            offset = (p.data_ptr() - bucket.param.data_ptr()) // p.element_size()
            assert offset % ALIGN == 0
            assert lo <= offset and offset + p.numel() <= hi  # inside its block's tile range
    # the padding is zero and the parameters cover the rest exactly once
    covered = torch.zeros(bucket.numel, dtype=torch.bool)
    for slot in bucket.slots:
        offset = (slot.view.data_ptr() - bucket.param.data_ptr()) // slot.view.element_size()
        assert not covered[offset : offset + slot.view.numel()].any()
        covered[offset : offset + slot.view.numel()] = True
    assert not bucket.param.cpu()[~covered].any() and not bucket.grad.cpu()[~covered].any()


@pytest.mark.parametrize("backend,device", FUSED)
def test_gradients_land_in_the_flat_buffer_and_are_rehomed_after_set_to_none(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, backend=backend, **SGD_KW)
    (bucket,) = _buckets(opt)
    xy = batches(1, device=device)[0]
    loss_fn(model, xy).backward()  # fresh gradient tensors (they were None)
    assert not any(_in_buffer(p.grad, bucket.grad) for p in model.parameters())
    opt.first_step()
    assert all(_in_buffer(p.grad, bucket.grad) for p in model.parameters())  # copied in and re-homed
    opt.zero_grad(set_to_none=False)
    assert all(_in_buffer(p.grad, bucket.grad) for p in model.parameters()) and not bucket.grad.any()
    loss_fn(model, xy).backward()
    assert (
        all(_in_buffer(p.grad, bucket.grad) for p in model.parameters()) and bucket.grad.any()
    )  # accumulated in place
    opt.second_step()


@pytest.mark.parametrize("backend,device", FUSED)
def test_stale_or_replaced_gradients_are_never_read(backend, device):
    """Per step, energies and perturbation must follow the current .grad, however it got there."""
    model, ref_model = tiny_resnet(device=device), tiny_resnet(device=device)
    opt = GEARSAM(model, NoStep, backend=backend, rho=0.05)
    ref = GEARSAM(ref_model, NoStep, backend="reference", rho=0.05)
    xy = batches(1, device=device)[0]

    def step(mutate):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad(set_to_none=False)
            loss_fn(m, xy).backward()
            mutate(m)
            o.first_step()
        torch.testing.assert_close(opt.block_stats()["energy"], ref.block_stats()["energy"], rtol=1e-6, atol=0)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
        opt.second_step()
        ref.second_step()

    step(lambda m: None)
    step(lambda m: setattr(m.fc.bias, "grad", None))  # was a view, now None: its region must read as zero
    step(lambda m: setattr(m.fc.weight, "grad", torch.full_like(m.fc.weight, 0.5)))  # assigned a new tensor
    step(lambda m: setattr(m.fc.weight, "grad", m.fc.weight.grad.detach().mul(3)))  # a new tensor, computed from ours
    step(lambda m: setattr(m.fc.bias, "grad", m.fc.bias.grad.detach()))  # another tensor object over our own memory
    step(lambda m: [setattr(p, "grad", None) for p in m.layer1.parameters()])  # a whole block without gradients
    assert opt.block_stats()["energy"][opt.block_names.index("layer1")] == 0
    step(lambda m: m.zero_grad(set_to_none=True) or loss_fn(m, xy).backward())  # the module's own zero_grad


@pytest.mark.parametrize("backend,device", FUSED)
def test_the_sync_passes_over_a_bucket_at_once_exactly_when_every_tensor_is_ours(backend, device):
    """The sync's common case (``Bucket.owns_every_tensor``) holds after a step with gradients in place and fails for
    each thing the per-parameter path mends: a replaced ``.data``, a ``.grad`` of None or another tensor."""
    model = tiny_resnet(device=device)
    opt = SAM(model, torch.optim.SGD, backend=backend, **SGD_KW)
    (bucket,) = _buckets(opt)
    xy = batches(1, device=device)[0]

    def step():
        opt.zero_grad(set_to_none=False)
        loss_fn(model, xy).backward()
        opt.first_step()
        loss_fn(model, xy).backward()
        opt.second_step()

    step()
    assert bucket.owns_every_tensor()
    for change in (
        lambda: setattr(model.fc.weight, "data", model.fc.weight.detach().clone()),
        lambda: setattr(model.fc.bias, "grad", None),
        lambda: setattr(model.fc.bias, "grad", model.fc.bias.grad.detach().clone()),
        lambda: setattr(model.fc.bias, "grad", model.fc.bias.grad.detach()),  # another object over our memory
    ):
        change()
        assert not bucket.owns_every_tensor()
        step()  # the per-parameter path puts it back (the first zero_grad gives fc.bias a gradient again)
        assert bucket.owns_every_tensor()
        bias = next(slot for slot in bucket.slots if slot.name == "fc.bias")
        assert _in_buffer(model.fc.weight, bucket.param) and model.fc.bias.grad is bias.grad_view


@pytest.mark.parametrize("backend,device", FUSED)
def test_replaced_parameter_data_is_rehomed_and_a_moved_one_is_refused(backend, device):
    model = tiny_resnet(device=device)
    opt = SAM(model, NoStep, backend=backend)
    (bucket,) = _buckets(opt)
    new_weight = torch.randn_like(model.fc.weight)
    model.fc.weight.data = new_weight.clone()  # e.g. a re-initialisation after the optimizer was built
    loss_fn(model, batches(1, device=device)[0]).backward()
    opt.first_step()
    assert _in_buffer(model.fc.weight, bucket.param) and not torch.equal(model.fc.weight, new_weight)  # perturbed
    opt.second_step()
    assert _in_buffer(model.fc.weight, bucket.param) and torch.equal(model.fc.weight, new_weight)

    model.fc.weight.data = model.fc.weight.data.double()
    with pytest.raises(RuntimeError, match=r"parameter 'fc.weight' was replaced by a tensor of another device, dtype"):
        opt.first_step()


def test_parameters_that_are_not_dense_are_refused():
    class Expanded(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 1).expand(3, 4))  # stride 0: one element seen four times

    with pytest.raises(ValueError, match=r"parameter 'w' .* overlaps itself or has gaps"):
        GEARSAM(Expanded(), torch.optim.SGD, backend="torch", partition="global", lr=0.1)
    GEARSAM(Expanded(), torch.optim.SGD, backend="reference", partition="global", lr=0.1)  # the reference copes


@pytest.mark.parametrize("backend,device", [on_device("torch", "cpu")])
def test_channels_last_parameters_keep_their_layout(backend, device):
    conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    stride = conv.weight.stride()
    opt = SAM(conv, torch.optim.SGD, backend=backend, lr=0.1)
    assert conv.weight.stride() == stride
    conv(torch.randn(2, 3, 5, 5)).sum().backward()
    assert conv.weight.grad.stride() == stride and _in_buffer(conv.weight.grad, _buckets(opt)[0].grad) is False
    opt.first_step()
    assert _in_buffer(conv.weight.grad, _buckets(opt)[0].grad)
    opt.second_step()


@pytest.mark.parametrize("backend,device", FUSED)
def test_memory_overhead_is_the_backup_plus_small_tables(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, partition="tensor", backend=backend, **SGD_KW)
    (bucket,) = _buckets(opt)
    report = opt.memory_overhead()
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors, n_blocks = len(list(model.parameters())), len(opt.blocks)
    assert report["backup"] == bucket.numel * 4
    # param, grad and the momentum buffer, reserved at construction (a compiled step cannot allocate it); the
    # optimizer's per-parameter state stays empty until the first step, as torch's
    assert list(bucket.state) == ["momentum_buffer"] and not opt.state
    assert report["padding"] == 3 * (bucket.numel - n_params) * 4
    assert bucket.numel - n_params <= ALIGN * n_tensors + TILE * n_blocks
    # O(blocks + tiles): two per-tile partial sums (an energy's, an inner product's) and tile -> block, per-block tile
    # ranges and counts
    assert report["tables"] == bucket.n_tiles * (2 * 8 + 4) + (n_blocks + 1) * 8 + n_blocks * 8
    assert report["total"] == report["backup"] + report["padding"] + report["tables"]
    # held besides the gradients once zero_grad(set_to_none=True) has freed their views
    assert report["grad_buffer"] == bucket.numel * 4
    reference = GEARSAM(tiny_resnet(), torch.optim.SGD, backend="reference", lr=0.1).memory_overhead()
    assert reference["backup"] == n_params * 4 and reference["grad_buffer"] == 0


def _vm_flags_at(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms offset ..."
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="no transparent huge pages")
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_the_flat_buffers_of_a_cpu_bucket_are_advised_onto_huge_pages(backend):
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))  # 4M parameters: 16 MiB per buffer
    opt = SAM(model, torch.optim.SGD, backend=backend, lr=0.1, momentum=0.9)
    (bucket,) = _buckets(opt)
    buffers = {"param": bucket.param, "grad": bucket.grad, "backup": bucket.backup, **bucket.state}
    assert list(bucket.state) == ["momentum_buffer"]
    for name, buffer in buffers.items():
        start, length = huge_page_range(buffer.data_ptr(), buffer.nbytes)
        assert length >= 6 * HUGE_PAGE, name  # 16 MiB holds at least seven whole huge pages, less one at the edges
        # "hg": the kernel keeps the advice on the mapping, whether or not it had a huge page free at hand
        assert "hg" in _vm_flags_at(start) and "hg" in _vm_flags_at(start + length - 1), name
    # advised before the zeros were written, and zeros still
    assert torch.count_nonzero(bucket.grad) == 0 and torch.count_nonzero(bucket.state["momentum_buffer"]) == 0


def test_huge_page_range_is_the_whole_huge_pages_inside_a_range():
    assert huge_page_range(HUGE_PAGE, 3 * HUGE_PAGE) == (HUGE_PAGE, 3 * HUGE_PAGE)
    assert huge_page_range(HUGE_PAGE - 64, 3 * HUGE_PAGE) == (HUGE_PAGE, 2 * HUGE_PAGE)
    assert huge_page_range(HUGE_PAGE + 64, 2 * HUGE_PAGE - 128) is None
    assert huge_page_range(5 * HUGE_PAGE + 1, HUGE_PAGE) is None


def test_buffers_that_hold_no_whole_huge_page_or_live_off_the_cpu_are_not_advised():
    assert not advise_huge_pages(torch.empty(1000))
    assert not advise_huge_pages(torch.empty(2**22, device="meta"))


def test_the_huge_page_setting_is_the_kernels_mode_in_brackets():
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(path):
        assert huge_page_setting() is None
        return
    with open(path) as f:
        text = f.read()  # e.g. "always [madvise] never"
    assert huge_page_setting() in ("always", "madvise", "never")
    assert f"[{huge_page_setting()}]" in text
