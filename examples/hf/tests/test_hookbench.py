"""The Hugging Face / timm stack under hookbench's pytest plugin (the `hookbench` fixture).

    pytest                                       all pass on the verified torch
    pytest --hookbench-fault fires_twice         the same checks under a broken hook: they fail
"""

import pytest

pytest.importorskip("transformers", reason="the hf extra: pip install 'hookbench[hf]'")
pytest.importorskip("timm", reason="the hf extra: pip install 'hookbench[hf]'")

from hfstack.workloads import GPT2, LLAMA_BF16, VIT, WORKLOADS  # noqa: E402


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_every_strategy_trains_like_the_standard_step(hookbench, workload):
    rows = hookbench.assert_parity(workload)
    # Gradient clipping needs every gradient's norm before any step: the optimizer in backward
    # refuses it in words (Llama, HF Trainer's max_grad_norm=1.0), in every mode.
    refused = [key.split("/")[1] for key, row in rows.items() if "refused" in row]
    in_backward = [s for s in (key.split("/")[1] for key in rows) if s.startswith("in_backward")]
    assert refused == (in_backward if workload.clip_grad_norm is not None else [])
    # Dropout draws the same masks in every run: the optimizer in backward is bit-exact.
    if workload is GPT2:
        assert rows["gpt2/in_backward"]["parity"] == "vs forloop: bit-exact"


@pytest.mark.parametrize("workload", [GPT2, VIT], ids=lambda w: w.name)
def test_zero2_trains_like_data_parallelism(hookbench, workload):
    hookbench.assert_zero2_parity(workload)


def test_activation_capture_leaves_training_as_it_was(hookbench):
    hookbench.assert_capture(LLAMA_BF16)


def test_memory(hookbench):
    # Bounds: the peaks measured on torch 2.14.1 (fake backend, bytes) plus 5%, so that a
    # release that keeps one more gradient or activation alive fails here.
    peaks = hookbench.assert_memory(VIT, at_most={"foreach": 19_640_000,
                                                  "in_backward": 14_690_000,
                                                  "zero2": 7_280_000})
    assert peaks["in_backward"] < peaks["foreach"]  # the gradients never all exist at once


def test_hook_contract(hookbench):
    hookbench.assert_hook_contract()
