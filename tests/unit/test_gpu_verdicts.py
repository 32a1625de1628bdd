"""The GPU check's verdicts (``scripts/gpu_verdicts.py``) on recorded log snippets: Megatron-LM's
training log lines (``megatron/training/training.py``'s format) and pytest's JUnit XML."""
from scripts import gpu_verdicts as v

LINE = (" [2026-11-26 10:00:0{i}] iteration {i:8d}/{n:8d} | consumed samples: {s:12d} | "
        "elapsed time per iteration (ms): 812.4 | learning rate: 1.000000E-03 | global batch "
        "size:     8 |{loss} loss scale: {scale} | grad norm: 1.234 | number of skipped "
        "iterations: {skip:3d} | number of nan iterations:   0 |")
FP32 = [5.964614, 5.963848, 5.923942, 5.848989, 5.857973, 5.848457]


def log(values, scale="1.0", skips=None):
    skips = skips or [0] * len(values)
    return "\n".join(LINE.format(i=i + 1, n=len(values), s=8 * (i + 1), scale=scale,
                                 skip=skip, loss="" if value is None
                                 else f" lm loss: {value:.6E} |")
                     for i, (value, skip) in enumerate(zip(values, skips)))


def test_fp32_passes_on_finite_losses_of_every_iteration():
    verdict = v.training("train/elastic/pp2/fp32", log(FP32), 0, 6)
    assert verdict.outcome == "PASS" and "5.964614" in verdict.detail
    assert v.training("k", log(FP32[:5]), 0, 6).outcome == "FAIL"
    assert v.training("k", log(FP32), 1, 6).detail == "exit code 1"
    assert v.training("k", log([*FP32[:5], float("nan")]), 0, 6).outcome == "FAIL"
    assert "nan" in v.training("k", log(FP32).replace("5.848457E+00", "NAN"), 0, 6).detail


def test_bf16_is_judged_against_fp32_within_its_band():
    bf16 = [5.964653, 5.963867, 5.924087, 5.848970, 5.858030, 5.848567]
    verdict = v.training("train/1f1b/pp2/bf16", log(bf16), 0, 6, log(FP32), "bf16")
    assert verdict.outcome == "PASS", verdict
    drifted = [*bf16[:5], bf16[5] * (1 + 2 * v.BANDS["bf16"])]
    assert v.training("k", log(drifted), 0, 6, log(FP32), "bf16").outcome == "FAIL"
    assert v.training("k", log(bf16), 0, 6, None, "bf16").outcome == "FAIL"


def test_fp16_must_apply_every_update():
    # As logged with an initial loss scale of 2^32: every iteration skipped, no loss logged.
    overflowed = log([None] * 6, scale="4294967296.0", skips=[1, 2, 1, 1, 1, 1])
    verdict = v.training("train/helix/pp4/fp16", overflowed, 0, 6, log(FP32), "fp16")
    assert verdict.outcome == "FAIL" and "[1, 2, 1, 1, 1, 1]" in verdict.detail
    fp16 = [value * (1 + 1e-4) for value in FP32]
    verdict = v.training("k", log(fp16, scale="65536.0"), 0, 6, log(FP32), "fp16")
    assert verdict.outcome == "PASS" and "0 skipped" in verdict.detail
    one_skip = log(fp16, skips=[0, 0, 1, 0, 0, 0])
    assert v.training("k", one_skip, 0, 6, log(FP32), "fp16").outcome == "FAIL"


def test_golden_keys_read_the_layout_from_the_tag():
    assert v.golden_key("pp2") == "golden/1f1b/pp2/fp32"
    assert v.golden_key("pp2_tp2_sp_ir") == "golden/1f1b-ir/pp2tp2/fp32"
    assert v.golden_key("pp4_vp2_interleaved") == "golden/interleaved/pp4/fp32"
    assert v.golden_key("pp4_sppo_mux_n5") == "golden/sppo-multiplex/pp4/fp32"
    assert v.golden_key("pp2_sppo_n6_offload") == "golden/sppo/pp2/fp32"
    assert v.golden_key("pp4_helix_recompute") == "golden/helix/pp4/fp32"
    assert v.golden_key("pp2_seq1f1b_uniform") == "golden/seq1f1b/pp2/fp32"


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.distributed.test_golden_megatron"
 name="test_loss_and_gradients_match_reference[learned-pp2]" time="1"/>
<testcase classname="tests.distributed.test_golden_megatron"
 name="test_loss_and_gradients_match_reference[learned-pp4_helix_recompute]" time="1">
 <failure
 message="AssertionError: layers.0.mlp.weight: relative norm error 3.1e-04 &gt; 1e-05&#10;x"
 >trace</failure></testcase>
<testcase classname="tests.distributed.test_golden_megatron"
 name="test_executor_1f1b_equals_megatron_1f1b[pp2-pp2_ir]" time="1"/>
<testcase classname="tests.distributed.test_golden_megatron"
 name="test_every_cpu_compat_patch_is_exercised" time="0">
 <skipped message="the CPU compatibility layer is installed only without CUDA"/></testcase>
<testcase classname="tests.unit.test_x" name="test_y" time="0">
 <error message="fixture broke">trace</error></testcase>
</testsuite></testsuites>"""


def test_golden_verdicts_per_layout_and_each_failed_test_named():
    lines = [verdict.line() for verdict in v.golden(JUNIT)]
    assert "PASS  golden/1f1b/pp2/fp32  1 test(s) of pp2 passed" in lines
    assert "PASS  golden/1f1b-ir/pp2/fp32  1 test(s) of pp2_ir passed" in lines
    assert "FAIL  golden/helix/pp4/fp32  failed: pp4_helix_recompute" in lines
    assert ("FAIL  golden/test/test_loss_and_gradients_match_reference[learned-pp4_helix_"
            "recompute]  AssertionError: layers.0.mlp.weight: relative norm error 3.1e-04 > "
            "1e-05") in lines
    assert not any("cpu_compat" in line for line in lines)


def test_unit_verdict_names_every_failed_test():
    verdicts = v.unit(JUNIT)
    assert verdicts[0].line() == "FAIL  unit  2 passed, 2 failed, 1 skipped"
    assert [verdict.key for verdict in verdicts[1:]] == [
        "unit/tests/distributed/test_golden_megatron.py::test_loss_and_gradients_match_"
        "reference[learned-pp4_helix_recompute]", "unit/tests/unit/test_x.py::test_y"]
    assert verdicts[2].detail == "fixture broke"


def test_report_round_trips_its_lines():
    verdicts = [v.Verdict("PASS", "train/sppo/pp2/bf16", "losses within 5e-03 of fp32"),
                v.Verdict("SKIP", "train/sppo/pp4/fp16", "not started within the time limit")]
    text = v.report("abc1234", "NVIDIA H100 80GB HBM3", verdicts)
    lines = text.splitlines()
    assert lines[:2] == ["commit abc1234", "device NVIDIA H100 80GB HBM3"]
    assert [v.parse_line(line) for line in lines[2:4]] == verdicts
    assert lines[-1] == "summary 1 PASS, 0 FAIL, 1 SKIP"
    assert v.parse_line(lines[0]) is None
