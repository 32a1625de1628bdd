"""Megatron-LM's variable-length configurations priced by the cost model and simulator
(``elastic_pipe.megatron_lm``), against sums of the cost model's own stage times."""
import pytest

from elastic_pipe.megatron_lm import Layout, _pipeline, price, balanced_cp, chunked_pp, dynamic, layouts, search, \
    static_cp
from elastic_pipe.megatron_packing import dp_balanced, dynamic_cp
from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import load_profile
from longctx.models import ModelConfig

MODEL = ModelConfig("tiny", 4, 512, 8, 2048, 1000)
HARDWARE = load_profile("h100")
LENGTHS = [6000, 300, 2500, 700, 1200, 4000, 150, 900]


def whole(docs):
    return Chunk(tuple(Piece(d, 0, 0, LENGTHS[d], True) for d in docs))


def step_time(cost, chunk):
    return cost.stage_forward(0, chunk) + cost.stage_backward(0, chunk)


def test_dynamic_cp_takes_each_micro_batch_at_its_slowest_ring():
    layout = Layout(1, 2, 1, 2)
    priced = dynamic(LENGTHS, MODEL, HARDWARE, layout, 80.0, 2048)
    expected = 0.0
    for step in dynamic_cp(LENGTHS, 4, 2048):
        expected += max(step_time(CostModel(MODEL, HARDWARE, ParallelConfig(
            pp=1, cp=group.size, dp=4 // group.size)), whole(group.documents))
            for group in step)
    assert priced.setting["recompute_num_layers"] == 0
    assert priced.iteration_time_s == pytest.approx(expected, rel=1e-9)


def test_dp_balanced_takes_the_slowest_replica():
    layout = Layout(1, 2, 1, 2)
    priced = balanced_cp(LENGTHS, MODEL, HARDWARE, layout, 80.0, 2048)
    cost = CostModel(MODEL, HARDWARE, ParallelConfig(pp=1, cp=2, dp=2))
    steps = dp_balanced(LENGTHS, 2, 2, 2048)
    expected = max(sum(step_time(cost, whole(step[d])) for step in steps) for d in range(2))
    assert priced.iteration_time_s == pytest.approx(expected, rel=1e-9)


def test_recomputation_is_the_fewest_layers_that_fit():
    layout = Layout(1, 1, 1, 1)
    free = static_cp(LENGTHS, MODEL, HARDWARE, layout, 80.0, 8192)
    assert free.setting["recompute_num_layers"] == 0
    # just under the peak without recomputation: k layers recomputed fit, k - 1 do not, and
    # the k layers' forwards are paid again
    budget = free.peak_memory_gb - 0.01
    squeezed = static_cp(LENGTHS, MODEL, HARDWARE, layout, budget, 8192)
    count = squeezed.setting["recompute_num_layers"]
    assert 0 < count <= MODEL.num_layers and squeezed.peak_memory_gb <= budget
    cost = CostModel(MODEL, HARDWARE, ParallelConfig(pp=1, memory_gb=budget))
    rows = [whole([0]), whole([5, 2, 4, 3, 1, 6, 7])]
    assert not _pipeline([[(cost, row)] for row in rows], count - 1)[1]
    assert squeezed.iteration_time_s - free.iteration_time_s == pytest.approx(
        count * sum(cost.layer_forward(row) for row in rows), rel=1e-9)
    assert static_cp(LENGTHS, MODEL, HARDWARE, layout, 2.3, 8192) is None


def test_chunked_pp_splits_rows_into_equal_spans():
    layout = Layout(1, 1, 2, 1)
    one = chunked_pp(LENGTHS, MODEL, HARDWARE, layout, 80.0, 8192, 1)
    four = chunked_pp(LENGTHS, MODEL, HARDWARE, layout, 80.0, 8192, 4)
    assert (one.micro_batches, four.micro_batches) == (2, 8)
    assert four.peak_memory_gb < one.peak_memory_gb  # a quarter of a row in flight per unit
    with pytest.raises(ValueError, match="not divisible"):
        chunked_pp(LENGTHS, MODEL, HARDWARE, layout, 80.0, 8192, 3)


def test_layouts_are_every_power_of_two_split():
    found = {str(layout) for layout in layouts(8, MODEL, max_tp=2, max_pp=2)}
    assert "TP2 CP2 PP2 DP1" in found and "TP1 CP8 PP1 DP1" in found
    assert all(layout.gpus == 8 for layout in layouts(8, MODEL))
    assert not any("TP4" in text for text in found)


def test_search_keeps_the_fastest_and_shows_what_it_tried():
    found = search(LENGTHS, MODEL, HARDWARE, 4, 80.0, 8192, max_pp=2)
    times = [t["time_s"] for t in found.tried if t["time_s"] is not None]
    assert found.best.iteration_time_s == min(times)
    assert {t["config"] for t in found.tried} == {"static-cp", "dp-balanced", "dynamic-cp",
                                                  "chunked-pp"}
    # what the bound skipped would not have been faster
    for entry in found.tried:
        if entry["outcome"] == "bound above the best":
            layout = next(lay for lay in layouts(4, MODEL, max_pp=2)
                          if str(lay) == entry["layout"])
            alone = price(entry["config"], LENGTHS, MODEL, HARDWARE, layout, 80.0, 8192,
                          entry["knob"])
            assert alone is None or alone.iteration_time_s >= found.best.iteration_time_s
