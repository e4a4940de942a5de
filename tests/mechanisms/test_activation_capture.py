"""Activation capture on torchvision ResNet-18 and ViTs and a diffusers UNet, against
torchvision's create_feature_extractor; statistics against torch's own float64 reductions on
adversarial data; selectors, flattening, cleanup, and the overhead benchmark.

Only the tests marked ``torchvision`` need torchvision (conftest.py skips them, with the reason,
where it does not import); the rest run without it."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections import OrderedDict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.nn.modules import module as module_mod

from hookbench.measure.memory import StorageTracker
from hookbench.mechanisms.activation_capture import (
    STATS,
    ActivationCapture,
    flatten,
    statistics,
)

IMAGE = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def torchvision():
    import torchvision

    return torchvision


@pytest.fixture(scope="module")
def resnet18(torchvision):
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


@pytest.fixture(scope="module")
def vit_b_16(torchvision):
    torch.manual_seed(0)
    model = torchvision.models.vit_b_16().eval()
    nn.init.normal_(model.heads.head.weight, std=0.02)  # zero-initialised: logits would be 0
    return model


# -- ResNet-18: calls per forward and the in-place trap -----------------------------------------


@pytest.mark.torchvision
@pytest.mark.smoke
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


@pytest.mark.torchvision
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


# -- statistics: against torch's own float64 reductions ------------------------------------------

# The tolerance, relative, the same for every dtype of the output: float16, bfloat16, float32,
# float64, bool and integers below 2**53 all convert to float64 exactly, so the capture and
# torch's reference both round in float64 only. It grows with n: a sum of n float64 terms added
# one after another is within n * 2**-53 of the exact sum, and torch's CPU std adds one after
# another (1.9e-12 off on ResNet-18's 1,605,632-element stem output, where the capture's
# pairwise sums are 7.6e-14 off, both against exact rational arithmetic). The floor 1e-13 is
# 3x the largest error of a small case, which is the reference's (see _torch_float64). Float32
# accumulation is 1e-7 off at best and 0, inf or 16% off on the cases below: rejected at any n
# here (< 2**21: tolerance < 3e-10).
def _rtol(n: int) -> float:
    return max(1e-13, n * 2.0**-53)


def _torch_float64(x: torch.Tensor) -> dict[str, float]:
    """Every statistic as torch's own reduction of x.double(). Empty: numel 0 and nan for the
    rest, hookbench's definition (torch has none: amin raises, vector_norm gives 0).

    torch.std's two passes have no correction term, so its std is off by ~(d / std)^2, d the
    rounding of its float64 mean: at most 3.1e-14 on these cases ("transposed mean 1e4 std
    1e-3", against exact rational arithmetic; the capture: 2e-16). float32, float16 and
    bfloat16 values of one binade sum exactly in float64; generated float64 and integer data
    keep mean/std <= 2**20, where even d = n 2**-53 |mean| gives < 4e-14 at their n <= 1600."""
    n = x.numel()
    if n == 0:
        return {s: 0 if s == "numel" else math.nan for s in STATS}
    xd = x.double()
    with warnings.catch_warnings():  # the std of one element: nan (correction=1) and a warning
        warnings.simplefilter("ignore", UserWarning)
        std = xd.std()
    return {"l2": torch.linalg.vector_norm(xd).item(), "rms": xd.square().mean().sqrt().item(),
            "mean": xd.mean().item(), "mean_abs": xd.abs().mean().item(), "std": std.item(),
            "min": xd.amin().item(), "max": xd.amax().item(), "numel": n}


def _errors(got: dict, x: torch.Tensor) -> dict[str, float]:
    """Per statistic, |got - torch's| / scale: scale |torch's|, except for the mean, whose
    scale is mean |x| (a sum's rounding is relative to the sum of magnitudes; where values
    cancel the mean may be ~0, and the float64 reference is only that accurate). 0 for a
    matching nan, inf or numel; inf for a mismatch of those or for a value that is no float."""
    expected, errors = _torch_float64(x), {}
    for s in STATS:
        g, e = got[s], expected[s]
        if s == "numel":
            errors[s] = 0.0 if type(g) is int and g == e else math.inf
        elif type(g) is not float:
            errors[s] = math.inf
        elif math.isnan(e) or math.isinf(e) or math.isnan(g) or math.isinf(g):
            errors[s] = 0.0 if g == e or (math.isnan(g) and math.isnan(e)) else math.inf
        else:
            scale = expected["mean_abs"] if s == "mean" else abs(e)
            errors[s] = 0.0 if g == e else abs(g - e) / scale if scale else math.inf
    return errors


def _disagreements(got: dict, x: torch.Tensor) -> list[str]:
    """The statistics in ``got`` not within _rtol of torch's float64 reductions of x."""
    expected, rtol = _torch_float64(x), _rtol(x.numel())
    return [f"{s}: got {got[s]!r}, torch float64 {expected[s]!r} (error {err:.3g} > {rtol:.3g})"
            for s, err in _errors(got, x).items() if not err <= rtol]


def _adversarial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype)

    f32 = torch.finfo(torch.float32)
    signs = torch.where(torch.rand(512, generator=g) < 0.5, -1.0, 1.0)
    return {
        # large mean, tiny spread: the old float32 std, sqrt((sum x^2 - n mean^2) / (n - 1)),
        # gives 0 at mean +-1e4 and 1e6 (the difference rounds below 0), 4.8x the std at mean
        # 10 and 16% too little at mean 1
        "float32 mean 1e4 std 1e-3": randn(4096) * 1e-3 + 1e4,
        "float32 mean -1e4 std 1e-3": randn(4096) * 1e-3 - 1e4,
        "float32 mean 10 std 1e-3": randn(4096) * 1e-3 + 10,
        "float32 mean 1 std 1e-3": randn(4096) * 1e-3 + 1,
        "float32 mean 1e6 std 1": randn(4096) + 1e6,
        "float32 constant 0.1": torch.full((1000,), 0.1),
        # huge: float32's l2 and sums overflow, float64's do not
        "float32 near 1e38": signs * (1e38 + 1e37 * randn(512)),
        "float32 largest finite": signs * f32.max,
        # tiny: float32 squares underflow to 0
        "float32 1e-38": randn(512) * 1e-38,
        "float32 subnormals": torch.randint(-100, 100, (512,), generator=g) * f32.smallest_normal
        * 2.0 ** -20,
        "float32 1e30 beside 1e-30": torch.cat([randn(256) * 1e30, randn(256) * 1e-30]),
        "float32 zeros": torch.zeros(100),
        "empty": torch.ones(0),
        "empty 3x0": torch.ones(3, 0),
        "single": torch.tensor([3.5]),
        "single -1e38 as 1x1": torch.tensor([[-1e38]]),
        # integers float32 cannot hold exactly, and bool
        "int64 above 2**24": torch.randint(2**25, 2**40, (1000,), generator=g),
        "int64 2**40 + [0, 2**20)": 2**40 + torch.randint(0, 2**20, (1000,), generator=g),
        "int64 negative": -(2**45) + torch.randint(0, 2**30, (1000,), generator=g),
        "int32 full range": torch.randint(-2**31, 2**31 - 1, (1000,), generator=g,
                                          dtype=torch.int32),
        "uint8": torch.randint(0, 256, (1000,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(1000, generator=g) < 0.3,
        "bool all false": torch.zeros(10, dtype=torch.bool),
        # not contiguous
        "transposed": randn(300, 200).t(),
        "transposed mean 1e4 std 1e-3": (randn(64, 48) * 1e-3 + 1e4).t(),
        "strided [::3]": randn(5000)[::3],
        "channels_last": randn(2, 8, 5, 5).to(memory_format=torch.channels_last),
        "expanded (stride 0)": randn(1).expand(1000),
        "column of a 2-d": randn(700, 3)[:, 1],
        # half precision
        "float16 near 65504 (l2 overflows float16)": (randn(1000) * 100 + 6e4).half(),
        "float16 subnormals": (torch.randint(-50, 50, (500,), generator=g) * 2.0 ** -24).half(),
        "float16 mean 1000 std 0.5": (randn(1000) * 0.5 + 1000).half(),
        "bfloat16 near 1e38": (randn(1000) * 1e38).bfloat16(),
        "bfloat16 mean 256 std 0.1": (randn(1000) * 0.1 + 256).bfloat16(),
        # float64
        "float64 mean 1e6 std 1e-3": randn(4096, dtype=torch.float64) * 1e-3 + 1e6,
        "float64 near 1e150": randn(512, dtype=torch.float64) * 1e150,
        "float64 near 1e-150": randn(512, dtype=torch.float64) * 1e-150,
        "float64 transposed": randn(60, 70, dtype=torch.float64).t(),
        # larger than one CPU chunk (2**18 elements): sums combined across chunks
        "float32 2.2 chunks mean 10 std 1e-2": randn(2 * 2**18 + 50_000) * 1e-2 + 10,
        "float32 2 chunks not contiguous": randn(2**18 + 1000, 2)[:, 0],
        "float64 2 chunks mean 1e4 std 1": randn(2**18 + 7, dtype=torch.float64) + 1e4,
    }


ADVERSARIAL = _adversarial()


class _Whole(torch.Tensor):
    """A tensor subclass: statistics then take the path a GPU takes (one float64 copy of the
    whole output, no reused CPU buffers), so a CPU-only run checks that path too."""


@pytest.mark.parametrize("path", ["cpu buffers", "whole tensor, as on GPU"])
@pytest.mark.parametrize("case", list(ADVERSARIAL))
@pytest.mark.smoke
def test_statistics_match_torch_float64_on_adversarial_data(case, path):
    x = ADVERSARIAL[case]
    got = statistics(x if path == "cpu buffers" else x.as_subclass(_Whole))
    assert list(got) == list(STATS)
    assert _disagreements(got, x) == []


@st.composite
def _generated(draw) -> torch.Tensor:
    """Any dtype; magnitudes from subnormal to near the dtype's largest; a spread from
    comparable to 2**-40 of the mean (float64 and integers: 2**-20, see _torch_float64);
    contiguous, transposed or strided."""
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                  torch.int64, torch.int32, torch.bool]))
    rows, cols = draw(st.integers(0, 40)), draw(st.integers(0, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    z = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    sign = draw(st.sampled_from([-1, 0, 1]))  # 0: data around zero
    if dtype == torch.bool:
        x = z < draw(st.floats(-3, 3))
    elif dtype.is_floating_point:
        lo, hi = {torch.float16: (-24, 13), torch.bfloat16: (-133, 124),
                  torch.float32: (-149, 124), torch.float64: (-500, 500)}[dtype]
        spread = draw(st.integers(lo, hi))
        mean = draw(st.integers(spread, min(hi, spread + (20 if dtype == torch.float64 else 40))))
        x = (sign * 2.0 ** mean + 2.0 ** spread * z).to(dtype)
    else:
        top = 62 if dtype == torch.int64 else 30
        spread = draw(st.integers(0, top - 2))
        mean = draw(st.integers(spread, min(top - 1, spread + 20)))
        x = (sign * 2.0 ** mean + (2.0 ** spread * z).clamp(-2.0 ** mean, 2.0 ** mean)).round()
        x = x.to(torch.int64).to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    return x.t() if layout == "transposed" else x[:, ::2] if layout == "strided" else x


@given(x=_generated(), whole=st.booleans())
def test_statistics_match_torch_float64_on_generated_data(x, whole):
    got = statistics(x.as_subclass(_Whole) if whole else x)
    assert _disagreements(got, x) == []


def _old_float32_std(x: torch.Tensor) -> float:
    """The faulty implementation: std from the float32 sum of squares minus n mean^2."""
    x, n = x.float(), x.numel()
    l2, mean = torch.linalg.vector_norm(x), x.mean()
    return ((l2.square() - n * mean.square()).clamp(min=0) / (n - 1)).sqrt().item()


@pytest.mark.parametrize("case, stat, faulty", [
    ("float32 mean 1e4 std 1e-3", "std", _old_float32_std),  # 0
    ("float32 mean 1 std 1e-3", "std", _old_float32_std),  # 16% off
    ("float32 near 1e38", "l2", lambda x: torch.linalg.vector_norm(x).item()),  # inf
    ("float32 near 1e38", "mean_abs", lambda x: x.abs().mean().item()),  # the sum: inf
    ("float32 1e-38", "rms", lambda x: x.square().mean().sqrt().item()),  # squares: 0
    ("int64 above 2**24", "mean", lambda x: x.float().mean().item()),
    ("int64 above 2**24", "max", lambda x: x.float().max().item()),
], ids=["old std, mean 1e4", "old std, mean 1", "float32 l2 overflows",
        "float32 sum overflows", "float32 squares underflow", "int64 as float32 (mean)",
        "int64 as float32 (max)"])
@pytest.mark.smoke
def test_the_comparison_rejects_float32_statistics(case, stat, faulty):
    # The check above can fail: each faulty float32 statistic, put in place of the capture's on
    # a case it passes, is rejected, and only that one.
    x = ADVERSARIAL[case]
    good = statistics(x)
    assert _disagreements(good, x) == []
    bad = _disagreements({**good, stat: faulty(x)}, x)
    assert len(bad) == 1 and bad[0].startswith(f"{stat}:"), bad


def test_statistics_subsets_and_misuse():
    x = ADVERSARIAL["float32 mean 1e4 std 1e-3"]
    s = statistics(x)
    # Only the statistics asked for, in that order, each the number of the full set to within
    # rounding (without std, the mean and l2 are summed without std's shift).
    sub = statistics(x, ("max", "rms", "mean"))
    assert list(sub) == ["max", "rms", "mean"] and sub["max"] == s["max"]
    assert sub == pytest.approx({k: s[k] for k in sub}, rel=1e-14, abs=0)
    assert list(statistics(x, ("std", "l2"))) == ["std", "l2"]
    assert statistics(x, ("numel",)) == {"numel": 4096}
    assert statistics(x, ()) == {}
    assert statistics(torch.ones(0), ("numel", "mean"))["numel"] == 0
    assert all(type(v) is float for k, v in s.items() if k != "numel")
    model = nn.Linear(2, 2)
    for bad, error, match in [(("median",), ValueError, r"unknown statistics \['median'\]"),
                              ("rms", TypeError, "a sequence of names"),
                              (("rms", 3), TypeError, r"got \[3\]")]:
        with pytest.raises(error, match=match):
            statistics(x, bad)
        with pytest.raises(error, match=match):
            ActivationCapture(nn.Sequential(model), stats=bad)
    assert not model._forward_hooks


class _Outputs(nn.Module):
    """Returns each of the given tensors, so that each is a captured output."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tensors = tensors

    def forward(self, x):
        return {k.replace(".", "_"): t for k, t in self.tensors.items()}


def test_capture_statistics_of_adversarial_outputs_match_torch_float64():
    # Through the hook and table()'s one read for all records, including integer, bool, half,
    # non-contiguous, empty and single-element outputs.
    cases = {k: t for k, t in ADVERSARIAL.items() if t.numel() < 2**18}
    model = nn.Sequential(_Outputs(cases))
    with ActivationCapture(model, stats=True) as cap:
        model(torch.ones(1))
    rows = cap.table()
    assert [r["path"] for r in rows] == [k.replace(".", "_") for k in cases]
    for row, record, x in zip(rows, cap.records, cases.values()):
        assert _disagreements({k: row[k] for k in STATS}, x) == [], row["path"]
        same = [record.value[k] == row[k] or math.isnan(row[k]) and math.isnan(record.value[k])
                for k in STATS]
        assert all(same), row["path"]  # the record read alone: the row's numbers


def test_numel_only_and_empty_outputs_in_a_capture():
    # stats=("numel",) leaves nothing to compute on the device; an empty batch gives empty
    # outputs. Neither may break the model's own forward.
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with ActivationCapture(model, stats=("numel",)) as cap:
        model(torch.ones(2, 4))
    assert [r.value for r in cap.records] == [{"numel": 6}, {"numel": 6}]
    assert [row["numel"] for row in cap.table()] == [6, 6]
    with ActivationCapture(model, stats=True) as cap:
        out = model(torch.ones(0, 4))
    assert out.shape == (0, 3)
    for r in cap.records:
        assert r.value["numel"] == 0
        assert all(math.isnan(r.value[k]) for k in STATS if k != "numel")


@pytest.mark.torchvision
def test_resnet18_statistics_mode_matches_torch_float64(resnet18):
    with ActivationCapture(resnet18, stats=True) as stats, ActivationCapture(resnet18) as full:
        resnet18(IMAGE)  # nested captures on one model: both see every call
    assert len(stats.records) == len(full.records) == 75
    # table() reads every record's statistics in one copy, before any record is read alone,
    # and computes those of full tensors itself: each row, and each record read alone, agrees
    # with torch's float64 reductions of the tensor the other capture kept (a mis-sliced
    # read, or statistics of the wrong record, fails).
    rows, full_rows = stats.table(), full.table()
    for s, f, row, full_row in zip(stats.records, full.records, rows, full_rows):
        assert (s.name, s.call, s.path, s.shape) == (f.name, f.call, f.path, f.shape)
        for got in (s.value, {k: row[k] for k in STATS}, {k: full_row[k] for k in STATS}):
            assert _disagreements(got, f.value) == [], (s.name, s.call)


# -- the peer: torchvision's create_feature_extractor (FX) ---------------------------------------


@pytest.mark.torchvision
def test_resnet18_equals_create_feature_extractor(resnet18):
    from torchvision.models.feature_extraction import create_feature_extractor

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


@pytest.mark.torchvision
def test_vit_equals_create_feature_extractor(vit_b_16):
    from torchvision.models.feature_extraction import create_feature_extractor

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
@pytest.mark.torchvision
def test_every_linear_of_vit_l_in_statistics_mode(torchvision):
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


@pytest.mark.peers
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


@pytest.mark.torchvision
def test_selectors_by_name_glob_type_and_predicate(resnet18):
    with ActivationCapture(resnet18, include=["fc", "layer4.*.conv?", nn.AdaptiveAvgPool2d,
                                              lambda n, m: n == "bn1"],
                           exclude="layer4.1.*") as cap:
        resnet18(IMAGE[:1])
    assert {r.name for r in cap.records} == {"fc", "layer4.0.conv1", "layer4.0.conv2",
                                              "avgpool", "bn1"}


@pytest.mark.torchvision
def test_device_and_dtype_of_kept_tensors(resnet18):
    with ActivationCapture(resnet18, include="fc", dtype=torch.float64, device="cpu") as cap:
        out = resnet18(IMAGE[:1])
    assert cap["fc"].dtype == torch.float64
    assert torch.equal(cap["fc"], out.detach().double())


@pytest.mark.torchvision
def test_gradients_flowing_out_of_modules(resnet18, torchvision):
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


@pytest.mark.torchvision
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


@pytest.mark.torchvision
@pytest.mark.parametrize("global_hook", [False, True])
def test_hooks_are_removed_when_forward_raises(resnet18, global_hook):
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


class _RegistersThenRaises(nn.Linear):
    """register_forward_hook registers, then raises: no handle comes back to remove."""

    def register_forward_hook(self, hook, **kwargs):
        super().register_forward_hook(hook, **kwargs)
        raise RuntimeError("registration failed")


class _RaisesBeforeRegistering(nn.Linear):
    def register_forward_hook(self, hook, **kwargs):
        raise RuntimeError("registration failed")


def _all_forward_hooks(model: nn.Module) -> list[dict]:
    return [getattr(m, attr) for m in model.modules() for attr in (
        "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")]


@pytest.mark.parametrize("case", [
    "unknown statistic", "statistics as a string", "selector matches nothing",
    "selector of no kind", "dtype of no kind", "registration raises before registering",
    "registration raises after registering", "global registration raises after registering",
])
def test_a_failed_construction_or_enter_leaves_the_model_as_it_was(case, monkeypatch):
    # The first Linear is hooked before the second fails to be; the model must come out
    # with no hook of the capture on any module and no global hook, whatever raised.
    middle = {"registration raises before registering": _RaisesBeforeRegistering,
              "registration raises after registering": _RegistersThenRaises}.get(case, nn.Linear)
    model = nn.Sequential(nn.Linear(2, 2), middle(2, 2), nn.Linear(2, 2))
    kwargs, error = {
        "unknown statistic": (dict(stats=("median",)), ValueError),
        "statistics as a string": (dict(stats="rms"), TypeError),
        "selector matches nothing": (dict(include=["0", "nothing"]), ValueError),
        "selector of no kind": (dict(include=["0", 3]), TypeError),
        "dtype of no kind": (dict(dtype="float64"), TypeError),
        "global registration raises after registering": (dict(global_hook=True), RuntimeError),
    }.get(case, ({}, RuntimeError))
    if case == "global registration raises after registering":
        register = module_mod.register_module_forward_hook

        def registers_then_raises(hook):
            register(hook)
            raise RuntimeError("registration failed")

        monkeypatch.setattr(module_mod, "register_module_forward_hook", registers_then_raises)
    global_before = dict(module_mod._global_forward_hooks)
    with pytest.raises(error, match="registration failed" if error is RuntimeError else None):
        with ActivationCapture(model, **kwargs):
            pytest.fail("entered")
    assert all(not hooks for hooks in _all_forward_hooks(model)), case
    assert module_mod._global_forward_hooks == global_before
    model(torch.ones(2))  # and it still runs


def test_gradient_hooks_do_not_accumulate_over_steps():
    # A training loop clears the capture every step. Every gradient hook must come off its
    # tensor once it fired (or at clear() or exit when it never fires), so that the number of
    # live handles is the same after 1 step as after 50, and each step records a gradient for
    # every captured output.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    outputs = []  # what the capture hooked, to look at the tensors' own hook dicts
    keep = model.register_forward_hook(lambda m, i, o: None)  # the model's, to be left alone
    spy = [m.register_forward_hook(lambda m, i, o: outputs.append(o)) for m in model]
    try:
        with ActivationCapture(model, grads=True, stats=("rms",)) as cap:
            live = []
            for step in range(50):
                cap.clear()
                model(x).square().sum().backward()
                assert len(cap.records) == 3
                assert all(r.grad is not None and r.grad["rms"] > 0 for r in cap.records)
                live.append(len(cap._handles) + len(cap._grad_handles))
                assert not any(o._backward_hooks for o in outputs), step
            assert live == [live[0]] * 50 and live[0] == 3  # the three forward hooks
            # Gradient hooks that never fire (no backward) come off at clear() and at exit.
            model(x)
            assert all(o._backward_hooks for o in outputs[-3:])
            cap.clear()
            assert not any(o._backward_hooks for o in outputs)
            model(x)
        assert not any(o._backward_hooks for o in outputs)
        assert len(model._forward_hooks) == 1  # the model's own hook stays
    finally:
        keep.remove()
        for handle in spy:
            handle.remove()


@pytest.mark.torchvision
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


@pytest.mark.torchvision
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


@pytest.mark.torchvision
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


class _Checkpointed(nn.Module):
    """Two blocks, the first under activation checkpointing when ``reentrant`` is not None."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        if self.reentrant is None:
            return self.head(self.block(x))
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("stats", [False, ("rms", "max")])
def test_checkpointed_forward_records_what_eager_records(reentrant, stats):
    # Backward recomputes the checkpointed block and reruns its forward hooks (reentrant: all of
    # them; non-reentrant: up to the last saved tensor); none of that is a forward of the model.
    x = torch.randn(3, 4, requires_grad=True)
    tables = []
    for mode in (None, reentrant):
        model = _Checkpointed(mode)
        with ActivationCapture(model, stats=stats) as cap:
            model(x).sum().backward()
        tables.append([(r.name, r.call, r.path, r.shape,
                        r.value if stats else r.value.tolist()) for r in cap.records])
        assert all(cap.calls(n) == 1 for n in ("block.0", "block.1", "block.2", "head"))
    assert tables[1] == tables[0]


class Pooled:
    """A library's own output container, registered with torch's pytree without keys (as
    TorchRec registers the KeyedTensor its EmbeddingBagCollection returns)."""

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self.values, self.lengths = values, lengths


class PooledEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> Pooled:
        return Pooled(self.table(ids).sum(1), torch.full((len(ids),), ids.shape[1]))


@pytest.fixture()
def pooled_is_a_pytree():
    import torch.utils._pytree as pytree

    pytree.register_pytree_node(Pooled, lambda p: ((p.values, p.lengths), None),
                                lambda children, _: Pooled(*children))
    try:
        yield
    finally:  # torch 2.4 has no _deregister_pytree_node
        if hasattr(pytree, "_deregister_pytree_node"):
            pytree._deregister_pytree_node(Pooled)
        else:
            pytree.SUPPORTED_NODES.pop(Pooled)


def test_a_container_registered_with_pytree_is_recorded_tensor_by_tensor(pooled_is_a_pytree):
    model = nn.Sequential(OrderedDict(pool=PooledEmbedding()))
    with ActivationCapture(model) as cap:
        out = model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    got = {r.path: r.value for r in cap.records if r.name == "pool"}
    assert sorted(got) == ["0", "1"], [(r.name, r.path) for r in cap.records]
    assert torch.equal(got["0"], out.values) and torch.equal(got["1"], out.lengths)
