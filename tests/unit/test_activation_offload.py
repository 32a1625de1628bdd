"""The executor's activation offloading (``OFFLOAD`` / ``RELOAD``) on one process: handles for
saved tensors, the host tier, the two levels (K/V stay), the meter's device-resident bytes."""
import pytest
import torch

from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.layers.memory import SavedTensorMeter, storage_key
from megatron.plugin.pipeline.offload import (ActivationOffloader, HostArena, HostMemory,
                                              HostMemoryExhausted, SavedHandle, host_tier)

KEY = (0, None)


def stack(layers: int = 16, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(m for _ in range(layers)
                                 for m in (torch.nn.Linear(width, width), torch.nn.Tanh())))


def captured_forward(offloader, model, x):
    with offloader.capture(KEY):
        return model(x).square().sum()


def as_bytes(tensor):
    return tensor.contiguous().view(torch.uint8)


def gradients(model):
    return [p.grad.clone() for p in model.parameters()]


def saved_tensors(offloader):
    return [h.tensor for h in offloader._units[KEY].handles]


@pytest.mark.parametrize("ratio", [0.3, 1.0])
def test_reloaded_tensors_equal_the_stored_ones_bit_for_bit(ratio):
    model, x = stack(), torch.randn(32, 64)
    model(x).square().sum().backward()
    expected = gradients(model)
    model.zero_grad()
    offloader = ActivationOffloader(HostMemory(), lambda unit: ratio)
    loss = captured_forward(offloader, model, x)
    before = [t.clone() for t in saved_tensors(offloader)]
    record = offloader.offload(KEY, resident=set())
    assert 0 < record.moved <= record.offloadable
    kept = [t for t in saved_tensors(offloader) if t is not None]
    assert 0 < len(before) - len(kept)
    if ratio == 1:  # all but the transposed weights the GEMMs saved (model state)
        assert kept and all(t._base is not None and t._base.is_leaf for t in kept)
    assert offloader.tier.used == record.moved
    offloader.reload(KEY)
    assert offloader.tier.used == 0 and offloader.tier.peak == record.moved
    for got, stored in zip(saved_tensors(offloader), before):
        assert got.dtype == stored.dtype and got.shape == stored.shape
        assert torch.equal(as_bytes(got), as_bytes(stored))
    offloader.before_backward(KEY)
    loss.backward()
    offloader.release(KEY)
    offloader.check_empty("test")
    for got, want in zip(gradients(model), expected):
        assert torch.equal(got, want)


def test_views_of_one_storage_come_back_as_views_of_one_storage():
    x = torch.randn(8, 6, requires_grad=True)
    offloader = ActivationOffloader(HostMemory(), lambda unit: 1.0)
    with offloader.capture(KEY):
        fused = x * 2.0
        a, b = fused[:, :3], fused[:, 3:]
        loss = (a * b).sum()
    offloader.offload(KEY, resident=set())
    offloader.reload(KEY)
    a_back, b_back = sorted(saved_tensors(offloader), key=lambda t: t.storage_offset())
    assert a_back.untyped_storage().data_ptr() == b_back.untyped_storage().data_ptr()
    assert torch.equal(a_back, a) and torch.equal(b_back, b)
    loss.backward()
    assert torch.equal(x.grad, 2.0 * torch.cat((b, a), dim=1))


def test_kv_store_entries_are_never_offloaded():
    """Two levels: K/V recorded in the store (read by later slices) stay on the device even at
    ratio 1; everything else of the unit moves."""
    x = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(8, 24, requires_grad=True)
    store = KVStore()
    offloader = ActivationOffloader(HostMemory(), lambda unit: 1.0)
    with offloader.capture(KEY):
        qkv = x @ weight
        q, k, v = qkv[:, :8], qkv[:, 8:16], qkv[:, 16:]
        store.record("doc", 0, 1, k, v)
        hidden = torch.softmax(q @ k.T, dim=-1) @ v
        loss = torch.tanh(hidden).sum()
    record = offloader.offload(KEY, resident=store.storage_keys())
    kept = [t for t in saved_tensors(offloader) if t is not None]
    assert kept and all(t.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
                        for t in kept)
    assert record.moved == record.offloadable > 0
    offloader.reload(KEY)
    loss.backward()
    assert x.grad is not None


def test_a_backward_without_reload_is_refused():
    model, x = stack(2), torch.randn(4, 64)
    offloader = ActivationOffloader(HostMemory(), lambda unit: 1.0)
    loss = captured_forward(offloader, model, x)
    offloader.offload(KEY, resident=set())
    with pytest.raises(RuntimeError, match="in host memory at its backward: the schedule has "
                                           "no RELOAD"):
        loss.backward()


def test_exhausted_host_memory_is_refused_and_nothing_is_half_written():
    model, x = stack(4), torch.randn(16, 64)
    offloader = ActivationOffloader(HostMemory(capacity_bytes=10_000), lambda unit: 1.0)
    loss = captured_forward(offloader, model, x)
    with pytest.raises(HostMemoryExhausted, match=r"host memory exhausted: offloading unit "
                                                  r"\(0, None\) needs .* MiB host budget"):
        offloader.offload(KEY, resident=set())
    assert offloader.tier.used == 0 and offloader.tier.moved == 0 and not offloader.records
    assert all(t is not None for t in saved_tensors(offloader))
    loss.backward()
    offloader.release(KEY)


def test_order_errors_name_the_missing_action():
    offloader = ActivationOffloader(HostMemory(), lambda unit: 1.0)
    with pytest.raises(RuntimeError, match="its forward did not capture"):
        offloader.offload(KEY, resident=set())
    captured_forward(offloader, stack(1), torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="never released by a backward"):
        offloader.check_empty("rank 0")


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_device_resident_saved_bytes_follow_the_ratio(ratio):
    """The meter's live bytes after an offload are the unit's resident bytes (here the views of
    the weights the GEMMs saved) plus ``1 - ratio`` of its offloadable bytes (within 10%); the
    reload brings the count back."""
    model, x = stack(), torch.randn(256, 64)
    meter = SavedTensorMeter()
    offloader = ActivationOffloader(HostMemory(), lambda unit: ratio)
    with meter.active():
        loss = captured_forward(offloader, model, x)
        held = meter.current
        record = offloader.offload(KEY, resident=set())
        planned = held - ratio * record.offloadable
        # The weight views stay: those of layers 1..15 (x needs no gradient, so layer 0's
        # GEMM saves no weight).
        assert record.offloadable == held - 15 * 64 * 64 * 4
        assert abs(meter.current - planned) <= 0.1 * planned
        assert meter.current == held - record.moved
        offloader.reload(KEY)
        assert meter.current == held
        loss.backward()
        offloader.release(KEY)
    assert meter.current == 0


def test_a_handle_counts_in_the_active_meter():
    meter = SavedTensorMeter()
    with meter.active():
        handle = SavedHandle(torch.ones(256), "unit 0")
        assert meter.current == 1024
        handle.held = None
        assert meter.current == 0


def test_offload_leaves_saved_tensors_outside_the_tier_where_they_are():
    """A tier offloads only what is resident in its memory (on CUDA: device tensors; a layer
    may also save host tensors). Here a tier that counts nothing as resident moves nothing,
    and the backward still gets every saved tensor."""

    class NothingResident(HostMemory):
        def resident(self, tensor):
            return False

    model, x = stack(layers=2), torch.randn(8, 64)
    model(x).square().sum().backward()
    expected = gradients(model)
    model.zero_grad()
    offloader = ActivationOffloader(NothingResident(), lambda unit: 1.0)
    loss = captured_forward(offloader, model, x)
    record = offloader.offload(KEY, resident=set())
    assert record.offloadable == 0 and record.moved == 0
    assert all(t is not None for t in saved_tensors(offloader))
    offloader.reload(KEY)
    offloader.before_backward(KEY)
    loss.backward()
    offloader.release(KEY)
    for got, want in zip(gradients(model), expected):
        assert torch.equal(got, want)
    assert HostMemory().resident(x)  # the CPU twin stands in for the device: all of it


def test_host_tier_by_device():
    assert type(host_tier(torch.device("cpu"))) is HostMemory
    with pytest.raises(ValueError, match="host capacity must be >= 0"):
        HostMemory(-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host buffers and a side "
                                                          "stream need a CUDA device")
def test_pinned_tier_frees_device_memory_and_round_trips_bit_for_bit():
    device = torch.device("cuda")
    model, x = stack().to(device), torch.randn(256, 64, device=device)
    model(x).square().sum().backward()
    expected = gradients(model)
    model.zero_grad()
    offloader = ActivationOffloader(host_tier(device), lambda unit: 1.0)
    assert type(offloader.tier).__name__ == "PinnedHostMemory"
    loss = captured_forward(offloader, model, x)
    before = [t.clone() for t in saved_tensors(offloader)]
    allocated = torch.cuda.memory_allocated(device)
    record = offloader.offload(KEY, resident={storage_key(x)})  # the caller still holds x
    offloader.tier.stream.synchronize()
    torch.cuda.empty_cache()
    assert allocated - torch.cuda.memory_allocated(device) >= record.moved > 0
    offloader.reload(KEY)
    offloader.before_backward(KEY)
    for got, stored in zip(saved_tensors(offloader), before):
        assert torch.equal(as_bytes(got), as_bytes(stored))
    loss.backward()
    offloader.release(KEY)
    for got, want in zip(gradients(model), expected):
        assert torch.equal(got, want)


def test_one_arena_serves_every_iteration():
    """A tier kept across iterations allocates its arena once: sized from the plan (here too
    small), it overflows in the first iteration with a buffer of its own, grows to the most
    bytes held at the next ``start_step``, and allocates nothing after; every reload equals
    what was stored. Two units held at once, freed out of order, share the arena."""
    model, x = stack(4), torch.randn(16, 64)
    tier = HostMemory()
    allocations = []
    for _ in range(3):
        tier.start_step(planned_bytes=1024)
        offloader = ActivationOffloader(tier, lambda unit: 1.0)
        losses, stored = [], []
        for key in ((0, None), (1, None)):
            with offloader.capture(key):
                losses.append(model(x + key[0]).square().sum())
            stored.append([t.clone() for t in (h.tensor for h in offloader._units[key].handles)])
            offloader.offload(key, resident=set())
        for key, before in zip(((0, None), (1, None)), stored):
            offloader.reload(key)
            got = [h.tensor for h in offloader._units[key].handles]
            assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(got, before))
        for key, loss in zip(((1, None), (0, None)), reversed(losses)):
            offloader.before_backward(key)
            loss.backward()
            offloader.release(key)
        assert tier.used == 0
        allocations.append(tier.step_allocations())
    assert allocations[0] >= 2  # the arena and at least one overflow
    assert allocations[1] == 1  # the arena, grown to what the first iteration held
    assert allocations[2] == 0
    assert tier.arena.size >= tier.peak


def test_freed_arena_regions_merge():
    arena = HostArena()
    arena.reserve(4 * HostArena.ALIGN)
    regions = [arena.take(HostArena.ALIGN) for _ in range(4)]
    for region in (regions[1], regions[2], regions[0], regions[3]):
        arena.give(region)
    whole = arena.take(4 * HostArena.ALIGN)
    assert whole.data_ptr() == arena.buffer.data_ptr() and arena.allocations == 1
