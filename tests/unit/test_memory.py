"""Saved-tensor accounting: bytes autograd holds for backward, on any device."""
import torch

from megatron.plugin.layers.memory import SavedTensorMeter


def test_meter_counts_saved_activations_and_returns_to_zero():
    meter = SavedTensorMeter()
    weight = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with meter.active():
        h = torch.tanh(x @ weight)          # saves x (input of mm) and tanh's output
        loss = (h * h).sum()                # saves h (twice, one storage)
    # x and h, 32 x 64 fp32 each; the weight (a leaf parameter) is not an activation.
    assert meter.current == 2 * 32 * 64 * 4
    assert meter.peak == meter.current
    loss.backward()
    del h, loss
    assert meter.current == 0
    assert meter.peak == 2 * 32 * 64 * 4
    meter.reset_peak()
    assert meter.peak == 0


def test_kept_tensors_count_until_dropped_and_share_storage_with_saved_ones():
    from megatron.plugin.layers.memory import keep

    meter = SavedTensorMeter()
    weight = torch.nn.Parameter(torch.ones(4, 4))
    x = torch.randn(8, 4)
    with meter.active():
        y = x @ weight  # autograd saves x for the weight's gradient (128 bytes)
        saved = meter.current
        assert saved == 128
        handle = keep(x)  # the same storage: not counted twice
        assert meter.current == saved
        other = keep(torch.zeros(16))
        assert meter.current == saved + 64
        assert keep(weight).tensor is weight and meter.current == saved + 64
        assert other.tensor.shape == (16,)
        del other
        assert meter.current == saved
    del y, handle
    assert meter.current == 0 and meter.peak == saved + 64
    assert keep(x).tensor is x  # no active meter: just a handle
