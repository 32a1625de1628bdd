"""Saved-tensor accounting: bytes autograd holds for backward, on any device."""
import torch

from megatron.plugin.memory import SavedTensorMeter


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
