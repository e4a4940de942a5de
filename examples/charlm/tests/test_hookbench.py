"""charlm's training stack under hookbench's pytest plugin (the `hookbench` fixture).

    pytest                                       all pass on the verified torch
    pytest --hookbench-fault fires_twice         the same checks under a broken hook: they fail
"""

import pytest

from charlm.workloads import CHARLM, CHARLM_BF16, WORKLOADS


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_every_strategy_trains_like_the_standard_step(hookbench, workload):
    rows = hookbench.assert_parity(workload)
    # fp16 needs a GradScaler that sees every gradient first: the optimizer in backward must
    # refuse it in words, and it does.
    refused = [key for key, row in rows.items() if "refused" in row]
    expected = [key for key in rows if key.split("/")[1].startswith("in_backward")]
    assert refused == (expected if workload.precision == "fp16" else [])


def test_zero2_trains_like_data_parallelism(hookbench):
    hookbench.assert_zero2_parity(CHARLM_BF16)


def test_memory(hookbench):
    # Bounds: the peaks measured on torch 2.14.1 (fake backend, bytes) plus 5%, so that a
    # release that keeps one more gradient or activation alive fails here.
    peaks = hookbench.assert_memory(CHARLM, at_most={"foreach": 748_000,
                                                          "in_backward": 748_000,
                                                          "zero2": 656_000})
    assert peaks["zero2"] < peaks["foreach"]  # 2 ranks' shards of the state and gradients


def test_hook_contract(hookbench):
    hookbench.assert_hook_contract()
