"""Peak memory of a training step: ViT-L/16 from ~6 GB to ~4 GB, on the fake backend (CPU CI)
and on a GPU; the tracker checked against real tensors and against torch's MemTracker; and an
injected memory regression that the checks must catch."""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch

from hookbench import report
from hookbench.measure import plot
from hookbench.measure.faults import inject
from hookbench.measure.memory import CATEGORIES, format_bytes, measure, table_unit
from hookbench.models.zoo import BENCHMARK_MLP
from hookbench.models.zoo import workload as zoo_workload
from hookbench.report import memory_section

GB = 1e9
VIT_L = zoo_workload("vit_l_16", batch_size=1)
STRATEGIES = ("foreach", "forloop", "fused", "in_backward", "in_backward_grouped_foreach")


@pytest.fixture(scope="session")
def vit_l():
    """Fake-backend ViT-L/16 measurements, each made once per session (~5-10 s each)."""
    cache: dict[str, object] = {}

    def get(strategy: str):
        if strategy not in cache:
            cache[strategy] = measure(VIT_L, strategy)
        return cache[strategy]

    return get


@pytest.fixture(scope="session")
def vit_l_sizes():
    """Exact sizes from the model's shapes: parameters P (each rounded to the allocator's 512 B,
    as the tracker counts), the number of parameters, and the largest parameter."""
    with torch.device("meta"):
        params = list(VIT_L.build().parameters())
    rounded = [-(-p.nbytes // 512) * 512 for p in params]
    return sum(rounded), len(params), max(rounded)


def check_fused_into_backward(result, standard) -> list[str]:
    """The memory promises of optimizer-in-backward; the list of those broken."""
    broken = []
    # The tutorial's figure: ~4 GB (params 1.2 + Adam state 2.4 + ~0.4 activations).
    if not 3.9 * GB <= result.peak <= 4.1 * GB:
        broken.append(f"peak {result.peak / GB:.3f} GB outside [3.9, 4.1] GB")
    # The saving is the point: at least 30% below the standard step (the tutorial: 6 -> 4 GB).
    if result.peak > 0.7 * standard.peak:
        broken.append(f"peak {result.peak / GB:.3f} GB is not 30% below {standard.peak / GB:.3f}")
    # Nothing but the unavoidable: within 2% of the floor (params + state + activations).
    if abs(result.above_floor) > 0.02:
        broken.append(f"peak is {result.above_floor:+.2%} from the floor")
    # Gradients never all alive: at most a few parameters' worth (the largest is 16.8 MB of
    # 1.22 GB), so 5% of all gradients is a generous bound.
    if result.gradients_alive_max > 0.05 * result.all_gradients:
        broken.append(f"{result.gradients_alive_max / GB:.3f} GB of gradients alive at once")
    return broken


# -- ViT-L/16, fake backend: the tutorial's figures ---------------------------------------------


def test_standard_foreach_step_is_about_6_gb(vit_l, vit_l_sizes):
    r = vit_l("foreach")
    P, n, _ = vit_l_sizes
    b = r.peak_breakdown
    assert r.peak_phase == "optimizer"
    assert b["parameters"] == P == r.parameters  # 304,326,632 fp32 parameters: 1.217 GB
    # Adam's exp_avg and exp_avg_sq (2P) and one scalar 'step' tensor per parameter (512 B each).
    assert b["optimizer_state"] == 2 * P + 512 * n == r.optimizer_state
    # Every gradient (P), plus 0.8 MB: the class token's gradient is a view that keeps the
    # whole 197-token gradient of the concatenation alive (AccumulateGrad steals it as is).
    assert P <= b["gradients"] <= P + 1_000_000
    # The foreach step's intermediates: one parameter-sized list (the tutorial's 1.2 GB).
    assert 0.98 * P <= b["temporaries"] <= 1.02 * P
    # The tutorial's ~6 GB; seen 6.088 GB here, byte-identical run to run.
    assert 6.0 * GB <= r.peak <= 6.2 * GB
    assert r.peak == sum(b.values())


# slow: two more ViT-L/16 steps, about 6 s; the default tier keeps the foreach step's
# breakdown (about_6_gb) and every strategy's floor
@pytest.mark.slow
def test_standard_forloop_and_fused_steps_have_their_own_breakdown(vit_l, vit_l_sizes):
    P, n, largest = vit_l_sizes
    state = 2 * P + 512 * n
    for strategy in ("forloop", "fused"):
        r = vit_l(strategy)
        # No foreach intermediates: params + grads + state, plus at most a few parameters'
        # worth of per-tensor temporaries (the for-loop handles one tensor at a time; fused
        # updates in place). NOTES.md saw 4.90 GB for the single-tensor path.
        assert r.optimizer_state == state
        floor = r.parameters + r.all_gradients + state
        assert floor <= r.peak <= floor + 3 * largest, strategy
        assert r.peak_breakdown["temporaries"] <= 3 * largest, strategy
        assert 4.8 * GB <= r.peak <= 5.0 * GB, strategy


@pytest.mark.parametrize("strategy",
                         ["in_backward", "in_backward_grouped_foreach", "in_backward_bucketed"])
def test_optimizer_in_backward_is_about_4_gb(vit_l, strategy):
    r = vit_l(strategy)
    assert check_fused_into_backward(r, vit_l("foreach")) == []
    assert r.peak_breakdown["gradients"] < 0.05 * r.all_gradients


def test_measurement_is_deterministic_and_rejects_bad_input():
    spec = zoo_workload("transformer")
    a, b = measure(spec, "foreach"), measure(spec, "foreach")
    assert a.peak == b.peak and a.timeline == b.timeline
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        measure(spec, backend="gpu")
    with pytest.raises(ValueError, match="unknown strategy 'peer'"):
        measure(spec, "peer")
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        measure(spec, warmup=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        measure(spec, "zero2", world_size=2, rank=2)
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        zoo_workload("vgg")


# -- the floor is a lower bound --------------------------------------------------------------------

# Every strategy hookbench measures, and ZeRO-2 at each rank of 2 and at the first and last of 8
# (ranks differ: rank 0's gradients come last, the last rank's first).
FLOOR_CASES = [(s, {}) for s in (*STRATEGIES, "in_backward_grouped")] + [
    ("zero2", {"world_size": w, "rank": r}) for w, r in ((2, 0), (2, 1), (8, 0), (8, 7))]


def below_floor(result) -> str | None:
    """What is wrong when a measured peak sits below its floor, which no step can do."""
    if result.peak < result.floor:
        return (f"{result.model}/{result.strategy}: peak {result.peak} below the floor "
                f"{result.floor} ({result.above_floor:+.2%}; {result.floor_breakdown})")
    return None


@pytest.mark.parametrize("name", ["transformer", "resnet18"])
@pytest.mark.parametrize("strategy, options", FLOOR_CASES)
def test_every_measured_step_sits_at_or_above_its_floor(name, strategy, options):
    kw = {"lr": 1e-3, "bucket_numel": 2**16} if strategy == "zero2" else None
    r = measure(zoo_workload(name), strategy, optimizer_kwargs=kw, **options)
    assert below_floor(r) is None
    # ... and it is a floor, not a formality: the strategy's own gradients count in it.
    assert r.floor_breakdown["gradients_needed"] > 0


def test_a_floor_that_a_step_can_beat_is_caught():
    # The ZeRO-2 floor before this check existed counted every gradient (as a standard step
    # needs them), and a rank's measured peak sat 11.8% below it (transformer, rank 0 of 8).
    from dataclasses import replace

    r = measure(zoo_workload("transformer"), "zero2", world_size=8,
                optimizer_kwargs={"lr": 1e-3, "bucket_numel": 2**16})
    all_gradients = r.parameters + r.optimizer_state + max(r.activations_peak, r.all_gradients)
    assert below_floor(replace(r, floor=all_gradients)) is not None
    assert below_floor(r) is None


# -- the tracker, cross-checked ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet18", "transformer"])
@pytest.mark.parametrize("strategy", ["foreach", "in_backward"])
@pytest.mark.smoke
def test_fake_and_real_tensors_give_the_same_bytes(name, strategy):
    fake = measure(zoo_workload(name), strategy, backend="fake")
    real = measure(zoo_workload(name), strategy, backend="eager")
    assert fake.peak == real.peak
    assert fake.peak_breakdown == real.peak_breakdown
    assert fake.timeline == real.timeline


# slow: torch's private MemTracker as a peer (about 6 s); the default tier keeps the
# fake-vs-real byte equality and the ~6 GB / ~4 GB figures
@pytest.mark.slow
def test_agrees_with_torch_memtracker():
    mem_tracker = pytest.importorskip(
        "torch.distributed._tools.mem_tracker",
        reason="torch.distributed._tools.mem_tracker (private) is not in this torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hookbench.measure.memory import materialize

    spec = zoo_workload("vit_b_16")
    with torch.device("meta"):
        model = spec.build()
    with FakeTensorMode():
        materialize(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)

        def step(i):
            x, y = spec.data(i)
            spec.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        step(0)
        tracker = mem_tracker.MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step(1)
        peer = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    # MemTracker rounds only CUDA tensors, so compare unrounded; its categories differ (it
    # counts foreach intermediates as optimizer state), its total must not. Seen: identical.
    ours = measure(spec, "foreach", round_to=1).peak
    assert abs(ours - peer) <= 0.01 * peer, (ours, peer)


def test_cuda_backend_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available; the gpu tier measures instead")
    with pytest.raises(RuntimeError, match="torch.cuda.is_available\\(\\) is False"):
        measure(zoo_workload("transformer"), backend="cuda")


# -- an injected memory regression is caught ----------------------------------------------------


def test_a_gradient_kept_alive_breaks_the_memory_checks(vit_l):
    with inject("keeps_gradients_alive"):
        leaky = measure(VIT_L, "in_backward")
    broken = check_fused_into_backward(leaky, vit_l("foreach"))
    assert any("outside [3.9, 4.1] GB" in b for b in broken), broken
    assert any("from the floor" in b for b in broken), broken
    # ... while the numbers without the fault pass, above.
    assert check_fused_into_backward(vit_l("in_backward"), vit_l("foreach")) == []


# -- GPU tier ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gpu_out(tmp_path_factory) -> Path:
    """Where GPU results go: $HOOKBENCH_OUT if set (the runner collects it), else a temp dir."""
    out = Path(os.environ.get("HOOKBENCH_OUT") or tmp_path_factory.mktemp("gpu"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.mark.gpu
def test_gpu_vit_l_from_6_to_4_gb(gpu_out, vit_l):
    results = {}
    for strategy in ("foreach", "in_backward"):
        snapshot = gpu_out / f"vit_l_16-{strategy}.pickle"
        r = measure(VIT_L, strategy, backend="cuda", snapshot_path=snapshot)
        results[strategy] = r
        print(f"\n{strategy}: max_memory_allocated {r.peak / GB:.3f} GB, reserved "
              f"{r.device['max_memory_reserved'] / GB:.3f} GB, NVML {r.device}, "
              f"snapshot {snapshot} (open at https://pytorch.org/memory_viz)")
        assert r.peak > 0
        with open(snapshot, "rb") as f:
            assert pickle.load(f)["segments"], "the snapshot holds no segments"
    std, fused = results["foreach"], results["in_backward"]
    # The tutorial's figures on a GPU: ~6 GB and ~4 GB. Allocator rounding is what the fake
    # backend models, so allow 5% for cuBLAS workspaces and kernels' own scratch space; Adam's
    # 'step' tensors stay on the CPU there (~150 kB less).
    assert abs(std.peak - vit_l("foreach").peak) <= 0.05 * vit_l("foreach").peak
    assert abs(fused.peak - vit_l("in_backward").peak) <= 0.05 * vit_l("in_backward").peak
    assert fused.peak <= 0.7 * std.peak
    (gpu_out / "gpu_memory.json").write_text(json.dumps(
        {s: r.to_dict() for s, r in results.items()}, indent=1, default=str))



# -- amounts in print: B, KB, MB or GB by size (issue 26) -----------------------------------------


@pytest.mark.parametrize("n, digits, printed", [
    (0, 3, "0 B"), (511, 3, "511 B"), (999, 3, "999 B"),  # below 1 KB: the exact count
    (1_000, 3, "1.00 KB"),  # decimal units: 1 KB = 1e3 B, as GB = 1e9 B (the ZeRO paper's)
    (999_999, 3, "1.00 MB"),  # rounded up into the next unit, not "1000 KB"
    (4_000_000, 3, "4.00 MB"),  # a 1M-parameter model's fp32 parameters
    (6_088_090_112, 3, "6.09 GB"), (6_088_090_112, 4, "6.088 GB"),  # ViT-L/16's standard step
    (16 * 7_500_000_000, 3, "120 GB"),  # the ZeRO paper's 7.5 B parameters, 16 bytes each
    (1_200_000_000_000, 3, "1200 GB"),  # nothing above GB
])
def test_an_amount_prints_in_the_unit_that_fits(n, digits, printed):
    assert format_bytes(n, digits) == printed


def test_a_table_takes_one_unit_from_its_largest_value():
    # ViT-L's report: GB with 3 decimals, as it always printed; zero stays 0.000.
    unit, cell = table_unit([6_088_090_112, 1_217_306_624, 800_768, 0])
    assert (unit, cell(6_088_090_112), cell(800_768), cell(0)) == ("GB", "6.088", "0.001",
                                                                    "0.000")
    # A 4 MB model: MB, every cell in it, the smallest (512 B) still above 0.000.
    unit, cell = table_unit([3_161_600, 15_854_592, 512])
    assert (unit, cell(15_854_592), cell(3_161_600), cell(512)) == ("MB", "15.855", "3.162",
                                                                     "0.001")
    # A cell that 3 decimals would round to zero gets the decimals that show it, to 6 at most.
    _, cell = table_unit([15_854_592, 400])
    assert (cell(15_854_592), cell(400)) == ("15.8546", "0.0004")
    _, cell = table_unit([6_088_090_112, 512])
    assert (cell(6_088_090_112), cell(512)) == ("6.088090", "0.000001")
    assert table_unit([511, 3])[0] == "B" and table_unit([511, 3])[1](3) == "3"  # never below 1 B
    assert table_unit([])[0] == "B"


@pytest.fixture(scope="module")
def small_model():
    """The benchmark MLP (0.79 M parameters, 3.2 MB in fp32): foreach and in backward."""
    return [measure(BENCHMARK_MLP, strategy) for strategy in ("foreach", "in_backward")]


def test_a_small_models_report_prints_no_zero_for_a_nonzero_amount(small_model):
    # In GB every cell of this model printed 0.0xx or 0.000 (issue 26); in MB, none that holds
    # memory reads 0.000, and each reads its amount to the table's last digit.
    section = memory_section(small_model)
    assert section.title.endswith("; MB)")
    for (cells, ok), r in zip(section.rows, small_model):
        assert ok
        alive, of = cells[-1].split(" of ")
        amounts = [r.peak, *(r.peak_breakdown[c] for c in CATEGORIES), r.host_peak, r.floor,
                   r.gradients_alive_max, r.all_gradients]
        printed = [*cells[1:7], cells[7], cells[8], alive, of]
        for text, n in zip(printed, amounts, strict=True):
            assert (float(text) == 0) == (n == 0), (r.strategy, text, n)
            assert abs(float(text) - n / 1e6) <= 0.5 * 10.0 ** -len(text.split(".")[1])


def test_the_memory_plot_is_in_the_unit_of_its_peak(small_model, monkeypatch, tmp_path):
    figures = []
    monkeypatch.setattr(plot, "_save", lambda fig, path: figures.append(fig) or path)
    plot.memory_timeline(small_model, tmp_path / "memory.png")
    (fig,) = figures
    peaks, *axes = fig.axes  # the peaks side by side on top, then one timeline per strategy
    assert len(axes) == len(small_model)
    assert peaks.get_xlabel().startswith("peak (MB)")
    assert [t.get_text() for t in peaks.get_yticklabels()] == [r.strategy for r in small_model]
    assert axes[0].get_ylabel() == "MB"
    assert [ax.get_title() for ax in axes] == [
        f"{r.strategy}: peak {format_bytes(r.peak)}" for r in small_model]
    assert axes[0].get_title().endswith(" MB")  # 15.9 MB, not "peak 0.02 GB"
    assert max(ax.get_ylim()[1] for ax in axes) == pytest.approx(small_model[0].peak / 1e6,
                                                                 rel=0.1)
    # readable at 1600 px: three timelines a row, 1595 px wide at the saved 110 dpi
    assert fig.get_size_inches()[0] * 110 == pytest.approx(1595)
    assert len({ax.get_position().x0 for ax in axes}) == min(3, len(axes))
    plot._pyplot().close(fig)


def test_the_zero2_rows_take_one_unit_from_the_largest(monkeypatch):
    # The transformer's rank 0 peaks (47 MB at N = 2, falling with N) in MB, the title saying
    # so; the gloo parity rows are left out here (they fail, stubbed), for time.
    def no_ranks(*args, **kwargs):
        raise RuntimeError("no ranks in this test")

    monkeypatch.setattr(report.launch, "run", no_ranks)
    monkeypatch.setattr(report, "ZERO2_RANKS", (2,))
    section = report.zero2_section(zoo_workload("transformer"), "fake", None, None)
    assert "rank 0's peak (MB) against its bound" in section.title
    rows = {cells[0]: cells[-1] for cells, ok in section.rows if ok}
    assert set(rows) == {"transformer rank 0 of 2", "transformer rank 0 of 2, bf16",
                         "transformer rank 0 of 2, offload"}
    for label, verdict in rows.items():
        assert re.fullmatch(r"peak \d\d\.\d{3} = 0\.\d\dx the bound \d\d\.\d{3} \(fails above "
                            r"1\.02x\)" + ("; without offload \\d\\d\\.\\d{3}, host \\d\\.\\d{3}"
                                             if label.endswith("offload") else ""),
                            verdict), verdict
    # A rank whose offload keeps each device copy alive has lost the saving, though its bound,
    # which counts the activations it holds, passes it (seen: 44.248 MB with offload against
    # 47.135 MB without, and 58.397 MB = 0.93x its bound under the fault).
    with inject("offload_keeps_device_copy"):
        section = report.zero2_section(zoo_workload("transformer"), "fake", None, None)
    assert [cells[0] for cells, ok in section.rows if not ok][-1:] == [
        "transformer rank 0 of 2, offload"]


def test_a_copy_into_an_offloaded_host_tensor_stays_host_memory():
    # The CUDA offload path creates its pinned host buffer as a host copy, then copy_()s the
    # activation into it on a side stream: copy_ returns the host tensor, which the tracker
    # must not count a second time as device memory (it read host 4096 and activations 4096).
    from hookbench.measure.memory import StorageTracker
    from hookbench.mechanisms import activation_offload

    value = torch.randn(1024)  # 4096 B, made before the measurement
    with StorageTracker() as tracker:
        with activation_offload._host_copy():
            host = torch.empty(1024)
        host.copy_(value)
    assert tracker.host == 4096
    assert tracker.current == 0, tracker.totals


class _FakeNVML:
    """pynvml as this test needs it: which device index a handle was asked for."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.asked: list[int] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.asked.append(index)
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        return [type("Process", (), {"pid": os.getpid(), "usedGpuMemory": 123})()]

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        return type("Memory", (), {"used": 456})()


@pytest.mark.parametrize("visible, uuids, index", [
    ("1,0", None, 1),
    ("GPU-bbb", ["GPU-aaa-1", "GPU-bbb-2"], 1),  # what torch and the driver accept besides
    ("MIG-ccc", ["GPU-aaa-1", "MIG-ccc-3"], 1),  # ordinals: a GPU's UUID, a MIG instance's
])
def test_nvml_finds_the_device_behind_any_cuda_visible_devices(monkeypatch, visible, uuids,
                                                              index):
    from hookbench.measure import memory

    nvml = _FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: uuids)
    assert memory._nvml_readings() == {"nvml_process_bytes": 123, "nvml_device_used_bytes": 456}
    assert nvml.asked == [index]
    # an id NVML does not list: said in the reading, never raised (NVML is information only)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-zzz")
    assert "no NVML device for this CUDA device" in memory._nvml_readings()["nvml"]
