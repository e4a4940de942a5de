"""hookbench.Workload: a training step as data, named by import path from a package that is
not hookbench, checked per strategy (``hookbench.gate.workload_checks``), recorded and gated."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from hookbench import Workload
from hookbench.cli import main
from hookbench.core.workload import checkpointed, configured, load
from hookbench.gate import workload_checks
from hookbench.gate.checks import Run
from hookbench.measure.faults import inject
from hookbench.mechanisms import optimizer_in_backward
from hookbench.models import vision
from hookbench.models.zoo import workload as zoo_workload

# A user's package, outside hookbench: a convolution over a sequence with a mask as a second
# input (so inputs are a tuple), and a head tied to the input projection.
PACKAGE = '''
import torch
import torch.nn.functional as F
from torch import nn

from hookbench import Workload


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6, bias=False)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.out = nn.Linear(6, 6, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x, mask):
        h = self.inp(x)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.out(torch.tanh(h)) * mask.unsqueeze(-1)


def batch(g):
    x = torch.randn(4, 5, 6, generator=g)
    mask = (torch.rand(4, 5, generator=g) > 0.2).float()
    return (x, mask), torch.randn(4, 5, 6, generator=g)


def loss(output, target):
    return F.mse_loss(output, target)


TAGGER = Workload("tagger", model=Tagger, batch=batch, loss=loss,
                  optimizer=(torch.optim.AdamW, {"lr": 1e-2}))
BOTH = [TAGGER, TAGGER.replace(name="tagger-bf16", precision="bf16", checkpointing="blocks")]


def make():
    return TAGGER


NOT_A_WORKLOAD = 3
'''


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """``userpkg`` in a project folder with a ``[tool.hookbench]`` table, as the current
    folder; removed from ``sys.modules`` and ``sys.path`` afterwards."""
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "workloads.py").write_text(PACKAGE)
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent('''
        [tool.hookbench]
        workloads = ["userpkg.workloads:BOTH"]
        baseline = "gate/baseline.json"
    '''))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] == "userpkg"]:
        del sys.modules[name]


def _tiny(**changes) -> Workload:
    def batch(g):
        return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)

    base = dict(name="tiny", model=lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)),
                batch=batch, loss=nn.functional.mse_loss)
    return Workload(**{**base, **changes})


@pytest.mark.parametrize("changes, error, words", [
    ({"name": ""}, ValueError, "non-empty string without '/'"),
    ({"name": "a/b"}, ValueError, "without '/'"),
    ({"model": nn.Linear(2, 2).weight}, TypeError, "model must be callable"),
    ({"optimizer": torch.optim.Adam}, TypeError, "(class, kwargs) pair"),
    ({"optimizer": (nn.Linear, {})}, TypeError, "torch.optim.Optimizer class"),
    ({"optimizer": (torch.optim.Adam, [])}, TypeError, "options must be a dict"),
    ({"optimizer": (torch.optim.SGD, {"lr": 0.1, "differentiable": True})}, ValueError,
     "differentiable=True steps in grad mode"),
    ({"precision": "fp8"}, ValueError,
     "precision must be one of ('fp32', 'bf16', 'fp16', 'bf16-true', 'fp16-true')"),
    ({"checkpointing": "all"}, ValueError, "checkpointing must be one of"),
    ({"compile": True}, TypeError, "compile must be None or a torch.compile backend name"),
    ({"seed": -1}, ValueError, "seed must be an int >= 0"),
])
def test_a_malformed_workload_is_refused_in_words(changes, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        _tiny(**changes)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_torch_cannot_step_a_modules_parameters_with_differentiable(cls):
    # Why the workload refuses differentiable=True: a torch that can would need it run instead.
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used "
                                           "in an in-place operation"):
        cls(model.parameters(), lr=0.1, differentiable=True).step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_build_and_data_are_deterministic_and_leave_the_rng_alone():
    w = _tiny()
    state = torch.random.get_rng_state()
    a, b = w.build(), w.build()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(torch.equal(s, t) for s, t in zip(w.data(3), w.data(3)))
    assert not torch.equal(w.data(3)[0], w.data(4)[0])
    assert w.batch_size == 4 and w.parameter_dtype == torch.float32


@pytest.mark.parametrize("returns, words", [
    (lambda g: torch.zeros(2), "must return \\(inputs, target\\)"),
    (lambda g: ([torch.zeros(2), 1.0], torch.zeros(2)),
     r"inputs and target must be tensors, or lists, tuples and dicts of them \(nested\), got "
     r"inputs\[1\]: float"),
])
def test_a_batch_of_the_wrong_shape_is_refused(returns, words):
    with pytest.raises(TypeError, match=words):
        _tiny(batch=returns).data(0)


class _Counted(nn.Linear):
    calls: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(f"{self.in_features}->{self.out_features}")
        return super().forward(x)


def test_checkpointing_blocks_recomputes_each_top_level_child_in_backward():
    _Counted.calls = []
    w = _tiny(model=lambda: nn.Sequential(_Counted(3, 4), nn.Tanh(), _Counted(4, 2)),
              checkpointing="blocks")
    model, x_y = w.build(), w.data(0)
    w.compute_loss(model, *x_y).backward()
    # Each block once in forward and once more in backward, where checkpoint recomputes it.
    assert sorted(_Counted.calls) == ["3->4", "3->4", "4->2", "4->2"]
    plain = w.replace(checkpointing="none").build()
    w.compute_loss(plain, *x_y).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                            plain.parameters()))
    with pytest.raises(ValueError, match="checkpointing=.blocks. selects no module of Linear"):
        _tiny(model=lambda: nn.Linear(2, 2), checkpointing="blocks").build()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(_Counted(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def test_checkpointing_repeated_recomputes_each_repeated_block_and_no_container():
    # torch's Sequential is each _Block's inner stack and the model itself: neither is a block.
    _Counted.calls = []
    make = lambda: nn.Sequential(_Counted(3, 4), _Block(), _Block(), _Counted(4, 2))  # noqa: E731
    w = _tiny(model=make, checkpointing="repeated")
    model, x_y = w.build(), w.data(0)
    assert [type(b) for b in checkpointed(model, "repeated")] == [_Block, _Block]
    w.compute_loss(model, *x_y).backward()
    assert sorted(_Counted.calls) == ["3->4", "4->2", *["4->4"] * 4]  # each block twice
    plain = w.replace(checkpointing="none").build()
    w.compute_loss(plain, *x_y).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                            plain.parameters()))
    for name, block, count in (("transformer", nn.TransformerEncoderLayer, 4),
                               ("resnet18", vision.BasicBlock, 8),
                               ("vit_b_16", vision.EncoderBlock, 12)):
        assert [type(b) for b in checkpointed(zoo_workload(name).build(), "repeated")] == (
            [block] * count)
    with pytest.raises(ValueError, match="checkpointing='repeated' selects no module of "
                                         "Sequential"):
        _tiny(model=lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)),
              checkpointing="repeated").build()


def test_compile_keeps_parameter_names_and_values():
    w = _tiny(compile="eager")
    model = w.build()
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    x, y = w.data(0)
    assert torch.equal(model(x), _tiny().build()(x))


def test_a_compiled_workload_trains_like_its_eager_self():
    rows = workload_checks.trajectories(_tiny(compile="eager"))
    assert [k for k, row in rows.items() if row.get("problems") or "error" in row] == []
    eager = workload_checks.trajectories(_tiny())
    assert rows["tiny/in_backward"]["sha256"] == eager["tiny/in_backward"]["sha256"]


def test_capture_takes_a_workload_with_tuple_inputs(user_package, capsys):
    assert main(["capture", "--workload", "userpkg.workloads:TAGGER", "--stats"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tagger, batch 4: 3 outputs from 3 modules (statistics)")
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["inp", "conv", "out"]


def test_named_by_import_path_from_a_users_package(user_package):
    assert [w.name for w in load("userpkg.workloads:TAGGER")] == ["tagger"]
    assert [w.name for w in load("userpkg.workloads:BOTH")] == ["tagger", "tagger-bf16"]
    assert [w.name for w in load("userpkg.workloads:make")] == ["tagger"]
    config = configured()
    assert config["workloads"] == ["userpkg.workloads:BOTH"]
    assert config["baseline"] == str(user_package / "gate" / "baseline.json")


@pytest.mark.parametrize("path, error, words", [
    ("userpkg.workloads", ValueError, "expected package.module:attribute"),
    ("userpkg.nothing:W", ValueError, "cannot import userpkg.nothing"),
    ("userpkg.workloads:MISSING", ValueError, "has no attribute 'MISSING'"),
    ("userpkg.workloads:NOT_A_WORKLOAD", TypeError, "expected a hookbench.Workload"),
])
def test_a_bad_import_path_says_what_is_wrong(user_package, path, error, words):
    with pytest.raises(error, match=words):
        load(path)


@pytest.mark.parametrize("table, words", [
    ('workloads = "userpkg.workloads:BOTH"', "workloads must be a list of import paths"),
    ('workload = ["userpkg.workloads:BOTH"]', "unknown keys \\['workload'\\]"),
])
def test_a_bad_tool_hookbench_table_is_refused(user_package, table, words):
    (user_package / "pyproject.toml").write_text(f"[tool.hookbench]\n{table}\n")
    with pytest.raises(ValueError, match=words):
        configured()


# slow: about 14 s; examples/charlm/check.sh runs the same [tool.hookbench] record and gate end to
# end in CI, and the default tier keeps the workload rows under a fault (below)
@pytest.mark.slow
def test_a_users_workloads_are_recorded_and_gated_with_no_arguments(user_package, capsys):
    """In the user's repository, `hookbench record` and `hookbench gate` read
    [tool.hookbench]; the gate passes on the torch that recorded."""
    assert main(["record"]) == 0
    recorded = json.loads((user_package / "gate" / "baseline.json").read_text())
    assert set(recorded) == {"recorded_with", "hooks", "workloads"}
    assert not (user_package / "gate" / "checkpoints").exists()  # the zoo's sections only
    assert main(["gate"]) == 0
    out = capsys.readouterr().out
    for row in ("tagger/in_backward", "tagger-bf16/zero2", "tagger-bf16/memory/in_backward"):
        assert row in out
    assert "vs forloop: bit-exact" in out and "GATE PASSED" in out
    assert main(["report", "--workload", "userpkg.workloads:TAGGER", "--sections", "memory",
                 "--out", str(user_package / "out")]) == 0
    assert "Peak memory of one training step (tagger, batch 4, AdamW" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["gate", "--workload", "userpkg.workloads:BOTH", "--baseline", "missing.json"],
     "missing.json"),
    (["record", "--workload", "userpkg.workloads:NOT_A_WORKLOAD"], "expected a hookbench"),
    (["report", "--workload", "userpkg.workloads:BOTH"], "names 2 workloads"),
])
def test_bad_workload_arguments_exit_2_with_one_line(user_package, capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_workloads_need_a_named_baseline(tmp_path, monkeypatch, capsys, user_package):
    (user_package / "pyproject.toml").write_text("[tool.hookbench]\n"
                                                 'workloads = ["userpkg.workloads:BOTH"]\n')
    assert main(["record"]) == 2
    assert "name the baseline of your workloads" in capsys.readouterr().err
    (user_package / "pyproject.toml").unlink()
    assert main(["gate", "--sections", "workloads"]) == 2
    assert "the workloads section needs --workload" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["fires_twice", "never_fires", "optimizer_arithmetic_changed"])
def test_the_workload_rows_fail_under_a_fault(fault):
    clean = workload_checks.trajectories(_tiny())
    with inject(fault):
        broken = workload_checks.trajectories(_tiny())
    assert all(not row["problems"] for row in clean.values())
    if fault == "optimizer_arithmetic_changed":  # every strategy alike: the checksum sees it
        assert all(broken[k]["sha256"] != clean[k]["sha256"] for k in clean)
    else:
        assert broken["tiny/in_backward"].get("problems") or "error" in broken["tiny/in_backward"]


def test_the_memory_rows_fail_when_gradients_are_kept():
    assert all(not row["problems"] for row in workload_checks.memory(_tiny()).values())
    with inject("keeps_gradients_alive"):
        rows = workload_checks.memory(_tiny())
    assert any("holds every gradient at once" in p or "costs memory" in p
               for row in rows.values() for p in row["problems"])


def test_fp16_is_refused_by_the_optimizer_in_backward_and_must_stay_refused(monkeypatch):
    w = _tiny(precision="fp16")
    rows = workload_checks.trajectories(w)
    assert rows["tiny/in_backward"] == {
        "refused": "RuntimeError: forward under float16 autocast (cpu)"}
    assert not rows["tiny/forloop"]["problems"]  # the standard step, with a GradScaler
    # A release (or an edit) that lets fp16 through is caught: the row fails.
    monkeypatch.setattr(optimizer_in_backward, "_refuse_fp16_autocast", lambda *a: None)
    accepted = workload_checks.trajectories(w)["tiny/in_backward"]
    assert "it must refuse" in accepted["problems"][0]


def test_on_another_cpu_the_sampled_parameters_decide():
    """A workload's row stores 64 evenly spaced elements of each parameter and its float64 norm,
    not the model; where the bits differ (another CPU), those decide, within the row's own
    tolerance: equal ones pass as CHANGED bits, one element off by 1e-3 fails."""
    wide = _tiny(model=lambda: nn.Linear(300, 2),
                 batch=lambda g: (torch.randn(4, 300, generator=g), torch.randn(4, 2, generator=g)))
    now = workload_checks.trajectories(wide)["tiny/forloop"]
    assert {k: len(v["values"]) for k, v in now["final"].items()} == {
        "weight": 64, "weight#norm": 1, "bias": 2, "bias#norm": 1}
    other_cpu = {**now, "sha256": "0" * 64}
    (cells, ok), = workload_checks.judge({"tiny/forloop": other_cpu}, {"tiny/forloop": now},
                                         Run(machine_note=" (another CPU)")).rows
    assert ok and cells[-1].startswith("CHANGED bits (another CPU); final parameters bit-exact")
    off = json.loads(json.dumps(other_cpu))
    off["final"]["weight"]["values"][7] += 1e-3
    (cells, ok), = workload_checks.judge({"tiny/forloop": off}, {"tiny/forloop": now},
                                         Run()).rows
    assert not ok and "FAIL" in cells[-1] and "weight" in cells[-1]


def test_the_gate_fails_a_changed_refusal_and_a_row_it_no_longer_measures():
    base = {"tiny/in_backward": {"refused": "RuntimeError: forward under float16 autocast"},
            "tiny/foreach": {"sha256": "0"}}
    now = {"tiny/in_backward": {"refused": "ValueError: something else"}}
    section = workload_checks.judge(base, now, Run())
    assert [(cells[0], bool(verdict)) for cells, verdict in section.rows] == [
        ("tiny/in_backward", False), ("tiny/foreach", False)]
    assert "CHANGED: now refuses" in section.rows[0][0][-1]
    same = workload_checks.judge({"tiny/in_backward": now["tiny/in_backward"]}, now, Run())
    assert same.ok and "refuses, as designed" in same.rows[0][0][-1]


class _CopiesWeights(nn.Module):
    """A factory that copies values into its weights (as SB3's policies and e3nn do), which a
    meta tensor cannot give."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.ones(2, 3).to(self.lin.weight.device).cpu())


def test_a_factory_that_fails_only_under_meta_is_told_so():
    with pytest.raises(ValueError, match=r"model\(\) raised .* under torch.device\('meta'\) "
                                         r"only \(it builds on the CPU\)"):
        _tiny(model=_CopiesWeights).check()
    # one that fails everywhere: said as before
    with pytest.raises(ValueError, match=r"model\(\) raised ZeroDivisionError"):
        _tiny(model=lambda: 1 / 0).check()
