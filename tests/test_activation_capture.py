"""Activation capture on torchvision ResNet-18 and ViTs and a diffusers UNet, against
torchvision's create_feature_extractor; selectors, flattening, cleanup, and the overhead
benchmark."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import OrderedDict

import pytest
import torch
from torch import nn

torchvision = pytest.importorskip("torchvision", reason="activation capture is checked on "
                                  "torchvision's models (not installed: tox -e torch213)")
from torchvision.models.feature_extraction import create_feature_extractor  # noqa: E402

from hookbench.activation_capture import (  # noqa: E402
    STATS,
    ActivationCapture,
    flatten,
    statistics,
)
from hookbench.memory import StorageTracker  # noqa: E402

IMAGE = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def resnet18():
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


@pytest.fixture(scope="module")
def vit_b_16():
    torch.manual_seed(0)
    model = torchvision.models.vit_b_16().eval()
    nn.init.normal_(model.heads.head.weight, std=0.02)  # zero-initialised: logits would be 0
    return model


# -- ResNet-18: calls per forward and the in-place trap -----------------------------------------


def test_resnet18_records_every_call(resnet18):
    with ActivationCapture(resnet18) as cap:
        resnet18(IMAGE)
    # 67 submodules, 75 calls: each BasicBlock calls its one ReLU twice (8 blocks), and these
    # are the module calls torchvision's forward makes (seen on torchvision 0.29.1).
    assert len(list(resnet18.named_modules())) - 1 == 67
    assert len(cap.records) == 75
    assert {r.name for r in cap.records} == {n for n, _ in resnet18.named_modules() if n}
    assert [cap.calls(f"layer{i}.{j}.relu") for i in range(1, 5) for j in range(2)] == [2] * 8
    assert cap.calls("relu") == 1  # the stem's ReLU: once


def test_resnet18_bn_output_is_not_the_relud_value(resnet18):
    # bn1 feeds ReLU(inplace=True). A hook that keeps its output by reference reads ReLU'd values
    # after forward; the capture clones, so it keeps the negatives bn1 really produced.
    kept = {}
    handle = resnet18.layer1[0].bn1.register_forward_hook(
        lambda m, i, o: kept.setdefault("by_reference", o))
    try:
        with ActivationCapture(resnet18, include="layer1.0.bn1") as cap:
            resnet18(IMAGE)
    finally:
        handle.remove()
    assert kept["by_reference"].min() >= 0  # the trap, demonstrated
    assert cap["layer1.0.bn1"].min() < 0
    assert torch.equal(cap["layer1.0.bn1"].clamp(min=0), kept["by_reference"])


def test_statistics_against_torch_and_subsets():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3 + 1
    s = statistics(x)
    expected = {"l2": x.norm(), "rms": x.square().mean().sqrt(), "mean": x.mean(),
                "mean_abs": x.abs().mean(), "std": x.std(), "min": x.min(), "max": x.max()}
    for name, value in expected.items():
        # float64 arithmetic on both sides; std via the sum of squares (mean/std ~ 1/3 here)
        assert s[name] == pytest.approx(float(value), rel=1e-12), name
    assert s["numel"] == 1000
    assert statistics(x, ("rms", "max")) == {"rms": s["rms"], "max": s["max"]}
    assert statistics(torch.ones(0), ("numel", "mean"))["numel"] == 0
    with pytest.raises(ValueError, match=r"unknown statistics \['median'\]"):
        ActivationCapture(nn.Linear(2, 2), stats=("median",))


def test_resnet18_statistics_mode_agrees_with_tensors(resnet18):
    with ActivationCapture(resnet18, stats=True) as stats, ActivationCapture(resnet18) as full:
        resnet18(IMAGE)  # nested captures on one model: both see every call
    assert len(stats.records) == len(full.records) == 75
    # table() reads every record's statistics in one copy, before any record is read alone:
    # row for row the numbers of reading one record at a time.
    rows, full_rows = stats.table(), full.table()
    for s, f, row, full_row in zip(stats.records, full.records, rows, full_rows):
        assert (s.name, s.call, s.path, s.shape) == (f.name, f.call, f.path, f.shape)
        expected = statistics(f.value)
        assert s.value == expected  # the same float32 arithmetic: bit-exact
        assert {k: row[k] for k in STATS} == expected == {k: full_row[k] for k in STATS}


# -- the peer: torchvision's create_feature_extractor (FX) ---------------------------------------


def test_resnet18_equals_create_feature_extractor(resnet18):
    # FX names a reused module's calls relu, relu_1; the capture addresses them by call index.
    nodes = {"layer1.0.relu": ("layer1.0.relu", 0), "layer1.0.relu_1": ("layer1.0.relu", 1),
             "layer1.0.conv2": ("layer1.0.conv2", 0), "layer3": ("layer3", 0), "fc": ("fc", 0)}
    peer = create_feature_extractor(resnet18, return_nodes=[*nodes, "layer1.0.bn1"])(IMAGE)
    with ActivationCapture(resnet18, include=[n for n, _ in nodes.values()] + ["layer1.0.bn1"]
                           ) as cap:
        resnet18(IMAGE)
    for node, key in nodes.items():
        assert torch.equal(cap[key], peer[node]), node
    # The peer falls into the in-place trap itself: its bn1 output is returned by reference
    # and reads as ReLU'd. The capture keeps what bn1 produced.
    assert peer["layer1.0.bn1"].min() >= 0 > cap["layer1.0.bn1"].min()
    assert torch.equal(cap["layer1.0.bn1"].clamp(min=0), peer["layer1.0.bn1"])


def test_vit_equals_create_feature_extractor(vit_b_16):
    # FX calls encoder_layer_0's first LayerNorm node "...ln"; the module is ln_1.
    nodes = {"encoder.layers.encoder_layer_0.ln": "encoder.layers.encoder_layer_0.ln_1",
             "encoder.layers.encoder_layer_3.mlp": "encoder.layers.encoder_layer_3.mlp",
             "encoder.ln": "encoder.ln", "heads.head": "heads.head"}
    peer = create_feature_extractor(vit_b_16, return_nodes=list(nodes))(IMAGE[:1])
    with ActivationCapture(vit_b_16, include=list(nodes.values())) as cap:
        vit_b_16(IMAGE[:1])
    for node, name in nodes.items():
        assert torch.equal(cap[name], peer[node]), node


@pytest.mark.slow
def test_every_linear_of_vit_l_in_statistics_mode():
    torch.manual_seed(0)
    model = torchvision.models.vit_l_16().eval()
    with torch.no_grad(), ActivationCapture(model, include=nn.Linear, stats=True) as cap:
        model(IMAGE[:1])
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    # Every Linear ran except each attention's out_proj: MultiheadAttention calls its weight
    # functionally, never the module, so hooks on out_proj do not fire (pytorch#78109).
    assert {r.name for r in cap.records} == {n for n in linears if not n.endswith("out_proj")}
    assert len(linears) == 24 * 3 + 1
    assert all(set(r.value) == set(STATS) for r in cap.records)


# -- diffusers UNet: every nn.Linear, ModelOutput flattened -------------------------------------


def test_unet_every_linear_and_model_output():
    diffusers = pytest.importorskip("diffusers", reason="diffusers is an optional extra: "
                                    "pip install -e '.[unet]'")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8).eval()
    sample, text = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 32)
    linears = {n for n, m in unet.named_modules() if isinstance(m, nn.Linear)}
    with ActivationCapture(unet, include=nn.Linear) as cap, ActivationCapture(
            unet, include=lambda n, m: n.endswith("down_blocks.0")) as blocks:
        out = unet(sample, 1, encoder_hidden_states=text)
    # Attention processors are functions, not modules: their to_q/to_k/to_v/to_out.0 Linears
    # are where the tutorial hooks, and every one of them ran.
    assert {r.name for r in cap.records} == linears
    assert any(n.endswith("attn2.to_k") for n in linears)
    # A down block returns (hidden, (residual per resnet layer, then the downsampler's)).
    assert [r.path for r in blocks.records] == ["0", "1.0", "1.1"]
    # The UNet's own ModelOutput flattens to its field name.
    assert [p for p, _ in flatten(out)] == ["sample"]


# -- outputs, selectors, gradients, errors, cleanup ----------------------------------------------


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    note: str


class _Odd(nn.Module):
    def forward(self, x):
        return {"a": (x, [x * 2, "skip"]), "b": _Out(x + 1, "text"), "c": None,
                "d": OrderedDict(e=x - 1)}


def test_nested_outputs_flatten_with_stable_paths():
    model = nn.Sequential(nn.Identity(), _Odd())
    with ActivationCapture(model, include="1") as cap:
        model(torch.ones(2))
    assert [r.path for r in cap.records] == ["a.0", "a.1.0", "b.hidden", "d.e"]
    assert torch.equal(cap["1", 0, "b.hidden"], torch.full((2,), 2.0))


def test_selectors_by_name_glob_type_and_predicate(resnet18):
    with ActivationCapture(resnet18, include=["fc", "layer4.*.conv?", nn.AdaptiveAvgPool2d,
                                              lambda n, m: n == "bn1"],
                           exclude="layer4.1.*") as cap:
        resnet18(IMAGE[:1])
    assert {r.name for r in cap.records} == {"fc", "layer4.0.conv1", "layer4.0.conv2",
                                              "avgpool", "bn1"}


def test_device_and_dtype_of_kept_tensors(resnet18):
    with ActivationCapture(resnet18, include="fc", dtype=torch.float64, device="cpu") as cap:
        out = resnet18(IMAGE[:1])
    assert cap["fc"].dtype == torch.float64
    assert torch.equal(cap["fc"], out.detach().double())


def test_gradients_flowing_out_of_modules(resnet18):
    # The gradient recorded for bn1 (whose output ReLU modifies in place) is the gradient with
    # respect to bn1's own output, as with a separate, not in-place ReLU.
    reference = torchvision.models.resnet18()
    reference.load_state_dict(resnet18.state_dict())
    reference.eval()
    for m in reference.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    grads = []
    for model in (resnet18, reference):
        with ActivationCapture(model, include=["layer1.0.bn1", "fc"], grads=True) as cap:
            model(IMAGE[:1]).square().sum().backward()
        grads.append({r.name: r.grad for r in cap.records})
        model.zero_grad(set_to_none=True)
    assert grads[0]["layer1.0.bn1"] is not None
    for name in ("layer1.0.bn1", "fc"):
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)


def test_a_selector_that_matches_nothing_suggests_names(resnet18):
    with pytest.raises(ValueError, match=r"'layr1' matches no module; did you mean \['layer1'"):
        ActivationCapture(resnet18, include="layr1")
    with pytest.raises(TypeError, match="a selector is a name or glob"):
        ActivationCapture(resnet18, include=[3])
    with pytest.raises(ValueError, match="leaves no module"):
        ActivationCapture(resnet18, include="fc", exclude="fc")
    with pytest.raises(TypeError, match="nn.Module"):
        ActivationCapture("resnet18")


def _hook_count(model):
    return sum(len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("global_hook", [False, True])
def test_hooks_are_removed_when_forward_raises(resnet18, global_hook):
    from torch.nn.modules import module as module_mod

    def boom(*_):
        raise RuntimeError("boom in layer2")

    failing = resnet18.layer2.register_forward_hook(boom)  # after layer1's hooks have fired
    try:
        before = (_hook_count(resnet18), len(module_mod._global_forward_hooks))
        with pytest.raises(RuntimeError, match="boom in layer2"):
            with ActivationCapture(resnet18, include="layer1*", global_hook=global_hook) as cap:
                resnet18(IMAGE[:1])
        assert (_hook_count(resnet18), len(module_mod._global_forward_hooks)) == before
    finally:
        failing.remove()
    assert cap.calls("layer1.1.relu") == 2  # what ran before the error was recorded


def test_global_hook_variant_records_the_same(resnet18):
    other = nn.Linear(2, 2)  # a module of another model: the global hook must ignore it
    with ActivationCapture(resnet18, global_hook=True) as glob:
        resnet18(IMAGE[:1])
        other(torch.ones(2))
    with ActivationCapture(resnet18) as per_module:
        resnet18(IMAGE[:1])
    assert [(r.name, r.call) for r in glob.records] == [(r.name, r.call)
                                                         for r in per_module.records]
    assert all(torch.equal(a.value, b.value) for a, b in zip(glob.records, per_module.records))


def test_missing_record_names_what_exists(resnet18):
    with ActivationCapture(resnet18, include="layer1.0.relu") as cap:
        resnet18(IMAGE[:1])
    with pytest.raises(KeyError, match=r"\('layer1.0.relu', 0, ''\), \('layer1.0.relu', 1, ''\)"):
        cap["layer1.0.relu", 2]


# -- overhead --------------------------------------------------------------------------------------


def _forward_peak(forward, device: str) -> int:
    """Peak bytes a forward allocates beyond what was live before it (the model's parameters):
    activations, and what the capture keeps. CPU: StorageTracker (CUDA's 512-byte rounding);
    CUDA: the allocator's own peak."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        forward()
        return torch.cuda.max_memory_allocated() - before
    with StorageTracker() as tracker:
        forward()
    return tracker.peak


@pytest.mark.benchmark(group="resnet18-capture")
@pytest.mark.parametrize("mode", ["plain", "stats", "stats_rms_mean_abs", "tensors"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_benchmark_capture_overhead(benchmark, resnet18, mode, device):
    # ResNet-18 forward, batch 1 at 224x224, every module captured: all statistics, the two a
    # coordinate check needs, or full tensors. Each mode's time over "plain" is its overhead
    # (conftest.py prints the ratios).
    model, x = copy.deepcopy(resnet18).to(device), IMAGE[:1].to(device)
    stats = {"stats": True, "stats_rms_mean_abs": ("rms", "mean_abs")}.get(mode, False)
    benchmark.extra_info.update(mode=mode, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if mode == "plain":
            forward = lambda: (model(x), sync())  # noqa: E731
        else:
            cap = stack.enter_context(ActivationCapture(model, stats=stats))
            # Statistics are read once per forward (one sync), as a coordinate check does.
            forward = lambda: (cap.clear(), model(x), cap.table() if stats else None,  # noqa: E731
                               sync())
        benchmark.extra_info["peak_bytes"] = _forward_peak(forward, device)
        benchmark(forward)
        assert mode == "plain" or len(cap.records) == 75
