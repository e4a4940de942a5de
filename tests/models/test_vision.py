"""hookbench.models.vision against torchvision 0.29: the zoo's resnet18, vit_b_16 and vit_l_16, built
from torch.nn, are torchvision's models in everything hookbench measures.

Where torchvision imports (tests marked ``torchvision``): the same parameters, buffers and
modules, with the same torch.nn settings; the same initial values from the same seed; the
same module calls; bit-identical outputs, updated batch-norm statistics and gradients with
torchvision's weights loaded (strict), also with dropout on; and the same fake-backend memory
measurement, to the byte and allocation by allocation, for every strategy the upgrade gate
records. Without torchvision: the zoo builds all three (with torchvision's import blocked)
with the known parameter counts, and the comparisons are shown to report a layout or setting,
a forward, and a tensor lifetime that differ.

Times on 2 CPU cores: 70-90 s with -m "not slow"; the ViT-L tests (marked slow) ~25 s more.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
import types
from dataclasses import asdict

import pytest
import torch
from torch import nn

from hookbench.core.workload import Workload
from hookbench.gate.memory import STRATEGIES as MEMORY_STRATEGIES, ZERO2_BUCKET, ZERO2_WORLD
from hookbench.measure.memory import measure
from hookbench.models import vision
from hookbench.models.zoo import workload as zoo_workload

MODELS = ("resnet18", "vit_b_16", "vit_l_16")
PARAMETER_COUNTS = {"resnet18": 11_689_512, "vit_b_16": 86_567_656, "vit_l_16": 304_326_632}
SETTING_TYPES = (bool, int, float, str, tuple, type(None))


def torchvision_model(name: str) -> nn.Module:
    import torchvision

    return getattr(torchvision.models, name)()


def _nn_class(module: nn.Module) -> type:
    """The first torch.nn class in the module's MRO (nn.Module for a model's own blocks)."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("torch.nn."))


def _settings(module: nn.Module) -> dict[str, object]:
    """A torch.nn layer's plain attributes: eps, stride, padding, inplace, p, batch_first, ..."""
    return {k: v for k, v in vars(module).items() if isinstance(v, SETTING_TYPES)}


def _is_nn_layer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn.")


def layout_differences(ours: nn.Module, theirs: nn.Module) -> list[str]:
    """How ``ours`` differs from ``theirs`` in layout, as a list (empty: the same layout).

    Compared: named_parameters and named_buffers (names, order, shapes, dtypes, requires_grad),
    the names of all modules in order and of those that own parameters, and for each module
    the torch.nn class it is (or derives from) and, for torch.nn layers, their settings.
    """
    diffs = []

    def rows(named):
        return [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in named]

    for what in ("named_parameters", "named_buffers"):
        a, b = rows(getattr(ours, what)()), rows(getattr(theirs, what)())
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append(f"{what}: {len(a)} vs {len(b)}, first difference at {first}: "
                         f"{a[first] if first < len(a) else None} vs "
                         f"{b[first] if first < len(b) else None}")
    mine, other = dict(ours.named_modules()), dict(theirs.named_modules())
    if list(mine) != list(other):
        diffs.append(f"module names: only ours {sorted(set(mine) - set(other))}, only "
                     f"torchvision's {sorted(set(other) - set(mine))}, or another order")
    owners = [{n for n, m in mods.items() if any(True for _ in m.parameters(recurse=False))}
              for mods in (mine, other)]
    if owners[0] != owners[1]:
        diffs.append(f"modules owning parameters: only ours {sorted(owners[0] - owners[1])}, "
                     f"only torchvision's {sorted(owners[1] - owners[0])}")
    for name in mine.keys() & other.keys():
        a, b = mine[name], other[name]
        if _nn_class(a) is not _nn_class(b):
            diffs.append(f"{name or 'model'}: {_nn_class(a).__name__} vs {_nn_class(b).__name__}")
        # The models' own blocks (ResNet, BasicBlock, MLPBlock, ...: torchvision's or ours) keep
        # other attributes; their forward is compared by running it.
        elif _is_nn_layer(a) and _is_nn_layer(b) and _settings(a) != _settings(b):
            diffs.append(f"{name}: settings {_settings(a)} vs {_settings(b)}")
    return diffs


def call_order(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The names of the modules a forward calls, in the order their calls end."""
    calls: list[str] = []
    handles = [m.register_forward_hook(lambda *_, name=name: calls.append(name))
               for name, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return calls


def step_differences(ours: nn.Module, theirs: nn.Module, spec, backward: bool = True
                     ) -> list[str]:
    """A forward and backward of both models on the spec's first batch, in their current
    modes: where the outputs, buffers (batch-norm statistics) or gradients are not bit for bit
    equal. Without ``backward``, the forward runs under no_grad (in eval mode, the fast path
    of nn.MultiheadAttention). The models must hold equal parameters and buffers beforehand."""
    x, y = spec.data(0)
    out = {}
    for key, model in (("ours", ours), ("theirs", theirs)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks, where p > 0
        with torch.set_grad_enabled(backward):
            output = model(x.clone())
        if backward:
            spec.loss(output, y).backward()
        out[key] = output.detach()
    diffs = [] if torch.equal(out["ours"], out["theirs"]) else [
        f"output differs by up to {(out['ours'] - out['theirs']).abs().max().item():.3g}"]
    buffers = dict(theirs.named_buffers())
    diffs += [f"buffer {n} differs" for n, b in ours.named_buffers()
              if not torch.equal(b, buffers[n])]
    if backward:
        params = dict(theirs.named_parameters())
        diffs += [f"gradient of {n} differs" for n, p in ours.named_parameters()
                  if (p.grad is None) != (params[n].grad is None)
                  or (p.grad is not None and not torch.equal(p.grad, params[n].grad))]
    return diffs


def loaded_pair(name: str, meta: bool = False) -> tuple[nn.Module, nn.Module]:
    """(ours, torchvision's), ours holding torchvision's state dict, loaded strictly. Ours starts
    from another seed so that the load matters; ``meta``: built on the meta device and given
    torchvision's tensors themselves (assign), which saves ViT-L's 1.2 GB copy."""
    torch.manual_seed(0)
    theirs = torchvision_model(name)
    torch.manual_seed(1)
    with torch.device("meta" if meta else "cpu"):
        ours = getattr(vision, name)()
    result = ours.load_state_dict(theirs.state_dict(), strict=True, assign=meta)
    assert not result.missing_keys and not result.unexpected_keys
    return ours, theirs


@pytest.fixture(scope="module")
def pair():
    """``loaded_pair(name)``, built once per module for resnet18 and vit_b_16 (4 s for ViT-B).
    Tests may run either mode, forward and backward: both models change alike."""
    cache: dict[str, tuple[nn.Module, nn.Module]] = {}

    def get(name: str) -> tuple[nn.Module, nn.Module]:
        if name not in cache:
            cache[name] = loaded_pair(name)
        return cache[name]

    return get


def TorchvisionSpec(name: str):  # noqa: N802 - reads like the zoo_workload it stands beside
    """The zoo's workload ``name`` built by torchvision (the zoo before hookbench.models.vision), with
    the same seeding, batches and loss."""
    return zoo_workload(name).replace(model=functools.partial(torchvision_model, name))


def gate_measure(spec, strategy: str):
    """One fake-backend measurement, called as the upgrade gate's memory section calls it."""
    return measure(spec, strategy, backend="fake", world_size=ZERO2_WORLD,
                   optimizer_kwargs={"lr": 1e-3, "bucket_numel": ZERO2_BUCKET}
                   if strategy == "zero2" else None)


# -- (a) layout -----------------------------------------------------------------------------------


@pytest.mark.torchvision
@pytest.mark.parametrize("name", MODELS)
def test_layout_is_torchvisions(name):
    with torch.device("meta"):  # shapes, dtypes and settings only: no 1.2 GB for ViT-L
        ours, theirs = getattr(vision, name)(), torchvision_model(name)
    assert layout_differences(ours, theirs) == []
    # The helper's parts, spelled out as asked of the rebuild.
    assert ([(n, p.shape, p.dtype) for n, p in ours.named_parameters()]
            == [(n, p.shape, p.dtype) for n, p in theirs.named_parameters()])
    assert ([(n, b.shape, b.dtype) for n, b in ours.named_buffers()]
            == [(n, b.shape, b.dtype) for n, b in theirs.named_buffers()])
    assert ({n for n, m in ours.named_modules() if list(m.parameters(recurse=False))}
            == {n for n, m in theirs.named_modules() if list(m.parameters(recurse=False))})
    assert sum(p.numel() for p in ours.parameters()) == PARAMETER_COUNTS[name]


@pytest.mark.torchvision
@pytest.mark.parametrize("name", ["resnet18", "vit_b_16"])
def test_same_initial_values_from_the_same_seed(name):
    """Built in torchvision's order with its initialisations, so the zoo's seeded models start
    where they started before hookbench.models.vision (for vit_l_16 the code path is vit_b_16's)."""
    ours, theirs = (zoo_workload(name).build(), TorchvisionSpec(name).build())
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.torchvision
@pytest.mark.parametrize("name", ["resnet18", "vit_b_16"])
def test_same_module_calls(name, pair):
    """Module hooks see the same calls in the same order (ResNet's one ReLU per block twice)."""
    ours, theirs = pair(name)
    x = zoo_workload(name).data(0)[0]
    calls = call_order(ours.eval(), x)
    assert calls == call_order(theirs.eval(), x)
    if name == "resnet18":
        assert calls.count("layer1.0.relu") == 2


# -- (b) forward and backward ---------------------------------------------------------------------


@pytest.mark.torchvision
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", ["resnet18", "vit_b_16"])
def test_forward_and_gradients_bit_identical(name, mode, pair):
    """Outputs and gradients of a forward and backward; in train mode also the batch-norm
    running statistics the forward updated (batch 2), in eval mode also a no_grad forward."""
    ours, theirs = pair(name)
    tracked = int(ours.bn1.num_batches_tracked) if name == "resnet18" else None
    ours.train(mode == "train")
    theirs.train(mode == "train")
    spec = zoo_workload(name, batch_size=2 if name == "resnet18" else 1)
    assert step_differences(ours, theirs, spec) == []
    if mode == "eval":
        assert step_differences(ours, theirs, spec, backward=False) == []
    elif name == "resnet18":
        assert ours.bn1.num_batches_tracked.item() == tracked + 1  # statistics were updated


@pytest.mark.torchvision
@pytest.mark.slow
def test_vit_l_forward_bit_identical():
    """ViT-L at batch 1, eval mode, forward only: ~12 s on 2 CPU cores (two forwards of 4.5 s
    and one build). Its blocks are vit_b_16's, whose backward and train mode are tested above."""
    ours, theirs = loaded_pair("vit_l_16", meta=True)
    assert step_differences(ours.eval(), theirs.eval(), zoo_workload("vit_l_16"),
                            backward=False) == []


def _tiny_vit_model(source: str) -> nn.Module:
    if source == "torchvision":
        from torchvision.models.vision_transformer import VisionTransformer

        return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                 hidden_dim=64, mlp_dim=128, num_classes=10, dropout=0.1,
                                 attention_dropout=0.1)
    return vision.VisionTransformer(patch_size=8, layers=2, heads=4, dim=64, mlp_dim=128,
                                    image_size=32, num_classes=10, dropout=0.1,
                                    attention_dropout=0.1)


def _tiny_vit_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)


def TinyViTSpec(source: str = "ours", model=_tiny_vit_model) -> Workload:  # noqa: N802
    """A small ViT with dropout and attention dropout on (the zoo's have p=0.0), ours or
    torchvision's: the paths that only dropout takes, and where it consumes random numbers."""
    return Workload("tiny_vit", model=functools.partial(model, source), batch=_tiny_vit_batch,
                    loss=nn.functional.cross_entropy)


@pytest.mark.torchvision
def test_vit_with_dropout_identical():
    ours, theirs = TinyViTSpec().build(), TinyViTSpec("torchvision").build()
    assert layout_differences(ours, theirs) == []
    a, b = ours.state_dict(), theirs.state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []  # same seed, same values
    assert step_differences(ours, theirs, TinyViTSpec()) == []  # train mode: dropout on
    ours_memory = gate_measure(TinyViTSpec(), "foreach")
    assert asdict(ours_memory) == asdict(gate_measure(TinyViTSpec("torchvision"), "foreach"))


# -- (c) fake-backend memory ----------------------------------------------------------------------


@pytest.mark.torchvision
@pytest.mark.parametrize("strategy", MEMORY_STRATEGIES)
@pytest.mark.parametrize("name", ["resnet18", pytest.param("vit_b_16", marks=pytest.mark.slow)])
def test_fake_memory_identical(name, strategy):
    """The upgrade gate's memory row, and every allocation before it (the whole timeline)."""
    ours, theirs = gate_measure(zoo_workload(name), strategy), gate_measure(TorchvisionSpec(name),
                                                                       strategy)
    assert ours.peak == theirs.peak
    assert ours.peak_breakdown == theirs.peak_breakdown
    assert ours.gradients_alive_max == theirs.gradients_alive_max
    assert asdict(ours) == asdict(theirs)


@pytest.mark.torchvision
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["foreach", "in_backward"])
def test_vit_l_fake_memory_identical(strategy):
    ours = gate_measure(zoo_workload("vit_l_16"), strategy)
    theirs = gate_measure(TorchvisionSpec("vit_l_16"), strategy)
    assert ours.peak == theirs.peak
    assert ours.peak_breakdown == theirs.peak_breakdown
    assert ours.gradients_alive_max == theirs.gradients_alive_max
    assert asdict(ours) == asdict(theirs)


# -- (d) no torchvision needed --------------------------------------------------------------------

_WITHOUT_TORCHVISION = r"""
import importlib.abc, json, sys

class NoTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torchvision":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NoTorchvision())
import torch
from hookbench.measure.memory import measure
from hookbench.models.zoo import workload as zoo_workload

counts = {n: sum(p.numel() for p in zoo_workload(n).build().parameters())
          for n in ("resnet18", "vit_b_16")}
with torch.device("meta"):
    counts["vit_l_16"] = sum(p.numel() for p in zoo_workload("vit_l_16").build().parameters())
peak = measure(zoo_workload("resnet18"), "foreach").peak  # a gate memory row, fake backend
loaded = "torchvision" in sys.modules
try:
    import torchvision
    blocked = False
except ModuleNotFoundError:
    blocked = True
print(json.dumps({"counts": counts, "peak": peak, "loaded": loaded, "blocked": blocked}))
"""


@pytest.mark.slow  # a subprocess that imports torch with torchvision blocked
def test_zoo_builds_without_torchvision():
    """With torchvision's import made to fail, the zoo builds all three models (ViT-L on the
    meta device) with their known parameter counts, and the fake backend measures resnet18."""
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCHVISION], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["blocked"], "the import blocker did not block torchvision"
    assert not got["loaded"]
    assert got["counts"] == PARAMETER_COUNTS
    assert got["peak"] > 0


# -- (e) the helpers see differences --------------------------------------------------------------


def _rename(model):
    p = model.fc._parameters.pop("bias")
    model.fc.register_parameter("bias_", p)


def _move_to_end(model):
    block = model.encoder.layers.encoder_layer_2
    block._modules["ln_1"] = block._modules.pop("ln_1")  # registered last: parameter order


BREAKAGES = {
    "renamed parameter": ("resnet18", _rename),
    "reshaped parameter": ("vit_b_16", lambda m: setattr(
        m.encoder, "pos_embedding", nn.Parameter(torch.zeros(1, 196, 768)))),
    "dtype": ("resnet18", lambda m: m.layer3[1].conv2.to(torch.float64)),
    "parameter order": ("vit_b_16", _move_to_end),
    "extra buffer": ("resnet18", lambda m: m.bn1.register_buffer("extra", torch.zeros(1))),
    "missing downsample": ("resnet18", lambda m: setattr(m.layer2[0], "downsample", None)),
    "frozen parameter": ("vit_b_16", lambda m: m.class_token.requires_grad_(False)),
    "LayerNorm eps": ("vit_b_16", lambda m: setattr(
        m.encoder.layers.encoder_layer_3.ln_2, "eps", 1e-5)),
    "ReLU not in place": ("resnet18", lambda m: setattr(m.layer2[1].relu, "inplace", False)),
    "attention not batch_first": ("vit_b_16", lambda m: setattr(
        m.encoder.layers.encoder_layer_0.self_attention, "batch_first", False)),
    "attention dropout": ("vit_b_16", lambda m: setattr(
        m.encoder.layers.encoder_layer_0.self_attention, "dropout", 0.1)),
    "GELU approximation": ("vit_b_16", lambda m: setattr(
        m.encoder.layers.encoder_layer_11.mlp[1], "approximate", "tanh")),
    "another layer type": ("vit_b_16", lambda m: m.encoder.layers.encoder_layer_1.mlp.__setitem__(
        1, nn.ReLU())),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_layout_helper_reports_a_difference(breakage):
    """Against an intact build of ours (the same layout as torchvision's, tested above), so
    this runs without torchvision."""
    name, breaks = BREAKAGES[breakage]
    with torch.device("meta"):
        intact = getattr(vision, name)()
    broken = copy.deepcopy(intact)
    assert layout_differences(broken, intact) == []
    breaks(broken)
    assert layout_differences(broken, intact) != []


def _block_without_final_relu(self, x):
    out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
    return out + (x if self.downsample is None else self.downsample(x))


def test_step_helper_reports_a_difference():
    """A forward that differs while the layout does not (a block that skips its last ReLU)
    shows up in the outputs and the gradients."""
    spec = zoo_workload("resnet18")
    intact = spec.build()
    broken = copy.deepcopy(intact)
    assert step_differences(broken, intact, spec) == []
    broken.layer4[1].forward = types.MethodType(_block_without_final_relu, broken.layer4[1])
    assert layout_differences(broken, intact) == []
    diffs = step_differences(broken, intact, spec)
    assert diffs[0].startswith("output differs")
    assert any(d.startswith("gradient of") for d in diffs)


def _holding_forward(self, x):
    """VisionTransformer.forward written as one expression: the same values, but the encoder's
    input is held until the head has run."""
    n = x.shape[0]
    x = self.conv_proj(x).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
    x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
    return self.heads(self.encoder(x)[:, 0])


def _holding_model(source: str) -> nn.Module:
    model = _tiny_vit_model(source)
    model.forward = types.MethodType(_holding_forward, model)
    return model


def HoldingSpec() -> Workload:  # noqa: N802
    return TinyViTSpec(model=_holding_model)


def test_memory_comparison_sees_a_tensor_held_longer():
    """The first version of hookbench.models.vision had this forward: outputs, gradients and even the
    peak were torchvision's, but the allocation timeline was not. The memory tests compare the
    whole measurement, so they see it."""
    intact, holding = TinyViTSpec(), HoldingSpec()
    assert step_differences(holding.build(), intact.build(), intact) == []
    a, b = gate_measure(holding, "foreach"), gate_measure(intact, "foreach")
    assert a.peak == b.peak
    assert a.timeline != b.timeline
    assert asdict(a) != asdict(b)
