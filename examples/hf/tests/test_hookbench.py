"""The Hugging Face / timm stack under hookbench's pytest plugin (the `hookbench` fixture).

    pytest                                       all pass on the verified torch
    pytest --hookbench-fault fires_twice         the same checks under a broken hook: they fail
"""

import pytest

pytest.importorskip("transformers", reason="the hf extra: pip install 'hookbench[hf]'")
pytest.importorskip("timm", reason="the hf extra: pip install 'hookbench[hf]'")

from hfstack.workloads import (GPT2, LLAMA_BF16, MIXTRAL, OPT_LAYERDROP, RESNET,  # noqa: E402
                               T5_ADAFACTOR, VIT, WORKLOADS)


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
    # Adafactor has no foreach implementation: those rows say so; the rest run.
    if workload is T5_ADAFACTOR:
        assert [key for key, row in rows.items() if "not_applicable" in row] == [
            "t5-adafactor/foreach", "t5-adafactor/in_backward_grouped_foreach"]


@pytest.mark.parametrize("workload", [GPT2, VIT, RESNET, OPT_LAYERDROP, MIXTRAL],
                         ids=lambda w: w.name)
def test_zero2_trains_like_ddp(hookbench, workload):
    rows = hookbench.assert_zero2_parity(workload)  # ZeRO-2 and the engines, from one launch
    # fp32 on gloo, an elementwise optimizer, no clipping: torch's DDP, bit for bit
    assert rows[f"{workload.name}/zero2"]["parity"].startswith("vs DDP on the same shares: "
                                                               "bit-exact;")
    engines = {k.rsplit("/", 1)[1]: r for k, r in rows.items() if "/engines/" in k}
    assert set(engines) == {"ddp", "fsdp2_zero2", "fsdp2_zero3", "fsdp2_in_backward"}
    if workload is OPT_LAYERDROP:  # LayerDrop: ranks reduce different parameters
        assert "different parameters" in engines["fsdp2_zero3"]["not_applicable"]
    else:  # with 2 ranks FSDP2's AVG is DDP's divide-then-sum, bit for bit
        assert engines["fsdp2_zero3"]["parity"].startswith("vs DDP on the same shares: bit-exact")
        assert engines["fsdp2_in_backward"]["parity"].startswith(
            "vs FSDP2 ZeRO-3 with a standard step: bit-exact")


def test_zero2_refuses_adafactor_in_words(hookbench):
    row = hookbench.assert_zero2_parity(T5_ADAFACTOR)["t5-adafactor/zero2"]
    assert row == {"refused": "ValueError: Adafactor is not known to update parameters "
                              "elementwise"}


def test_activation_capture_leaves_training_as_it_was(hookbench):
    hookbench.assert_capture(LLAMA_BF16)


def test_memory(hookbench):
    # Bounds: the peaks measured on torch 2.14.1 (fake backend, bytes) plus 5%, so that a
    # release that keeps one more gradient or activation alive fails here.
    peaks = hookbench.assert_memory(VIT, at_most={"foreach": 19_640_000,
                                                  "in_backward": 14_690_000,
                                                  "zero2": 7_280_000})
    assert peaks["in_backward"] < peaks["foreach"]  # the gradients never all exist at once


@pytest.mark.parametrize("workload", [OPT_LAYERDROP, MIXTRAL], ids=lambda w: w.name)
def test_memory_where_fake_tensors_cannot_run_the_model(hookbench, workload):
    # LayerDrop reads a value; MoE's grouped_mm has no float32 meta kernel: real CPU tensors.
    # Bounds: the peaks measured on torch 2.14.1 (eager backend, bytes) plus 5%.
    bounds = {"opt-layerdrop": 4_110_000, "mixtral": 6_720_000}
    peaks = hookbench.assert_memory(workload, at_most={"foreach": bounds[workload.name]})
    assert peaks["in_backward"] <= peaks["foreach"]


def test_hook_contract(hookbench):
    hookbench.assert_hook_contract()
