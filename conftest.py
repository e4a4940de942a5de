"""This repository's pytest configuration: tiers, profiles, seeding, the GPU and torchvision
gates, benchmark ratios and the hook-leak guard. What a user's suite gets too (the
``--hookbench-fault`` option, the ``hookbench`` fixture) is the plugin, hookbench/pytest_plugin.py.

Test tiers (markers are registered in pyproject.toml and enforced with --strict-markers):

    pytest -m smoke                     the smoke tier: each mechanism's parity, a fault each
                                        must catch, the command line; under a minute
    pytest -n auto                      the default tier: all but what is marked slow and the
                                        benchmarks, on every core (pytest-xdist; plain
                                        ``pytest`` runs it in one process); about 4 minutes on
                                        2 cores with CI=true
    pytest -m slow                      the slow tier: end-to-end fault runs, the gate's
                                        self-check, large models, other world sizes
    pytest -m ""                        both
    pytest -m peers                     what needs an optional extra (DeepSpeed, mup, diffusers,
                                        transformers and timm, torchtune); each skips with a
                                        reason where it is not installed
    pytest -m gpu --benchmark-enable    the GPU tier; needs CUDA, each test skips with a reason
    pytest -m distributed               tests that spawn torch.distributed worker processes
    pytest --hypothesis-profile thorough    property tests with many more examples
    pytest --benchmark-only             the benchmark tier: only the pytest-benchmark benchmarks
    pytest --benchmark-compare          compare with the newest run stored in baselines/benchmarks
    pytest --hookbench-fault NAME       the suite with a PyTorch fault injected: it must fail
    tox -e torch24 (torch28, torch211, torch213, torch215)
                                        the suite on each release the gate claims (torchvision
                                        tests skip with a reason)
    hookbench gate; hookbench selfcheck the upgrade gate against baselines/gate.json (docs/gate.md)

Hypothesis profiles: ``ci`` (derandomized, no deadline, moderate examples; the default when the
CI variable is set), ``dev`` (the default otherwise: fewer examples), ``thorough``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import random
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from hookbench.core import launch
from hookbench.core.leak_guard import HookLeakGuard, HookTracker
from hookbench.core.workload import seeded_rngs
from hookbench.gate.step_time import WHOLE_STEP_PAIRS

# The plugin is an entry point where hookbench is installed; a plain checkout (another torch
# release run from the tree) loads it from here, and only then: an installed copy registered
# under another name would otherwise be loaded twice.
if not any(ep.value == "hookbench.pytest_plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["hookbench.pytest_plugin"]

# Each example trains small models for a few steps (tens of ms), so no per-example deadline:
# a slow CI core must not turn into a flaky failure. Derandomized in CI so that a run passes the
# same way every time.
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# Under an injected fault the suite is expected to fail: report the first failing example
# without spending minutes shrinking it.
settings.register_profile("fault", settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark opens its storage
def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--hookbench-fault"):
        settings.load_profile("fault")
    _share_the_cores()
    # What collection draws (a module's constants) is the same every run; torch would seed
    # its generator at random in each process. Tests and wider fixtures start from seed 0.
    torch.manual_seed(0)
    random.seed(0)
    # pytest-benchmark stores runs in ./.benchmarks relative to the current directory; the
    # committed baselines live in baselines/benchmarks, wherever pytest is started from.
    if config.getoption("benchmark_storage", None) == "file://./.benchmarks":
        config.option.benchmark_storage = f"file://{config.rootpath / 'baselines' / 'benchmarks'}"


_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _share_the_cores() -> None:
    """Under pytest-xdist (``-n N``), each worker's torch gets its share of the cores, and so do
    the processes it starts (ranks, ``hookbench`` commands). The suite's models are small: on 2
    cores a second intra-op thread made the gate 1.06x faster for 1.33x the CPU time (measured:
    119 s against 126 s), so two workers of one thread finish far sooner than one of two, and
    two of two would oversubscribe the cores. The gate passes against baselines/gate.json on
    one thread as on two; a test that needs references summed in another order than the
    ranks asks for ``other_order``."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        for name in _THREAD_VARIABLES:
            os.environ.setdefault(name, threads)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """Stored benchmark runs say which torch, CUDA and GPU they ran on."""
    machine_info["torch"] = torch.__version__
    machine_info["cuda"] = torch.version.cuda
    machine_info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None


# The ratios that matter, from one run's medians: (label, benchmark group, the extra_info value
# of the slower and of the reference benchmark, target). The targets are hookbench's goals,
# shown beside the measurement; speed is gated by --benchmark-compare-fail, never by a test.
RATIOS = (
    ("in backward, grouped+foreach / foreach step", "adam-step", "in_backward_grouped_foreach",
     "foreach", 1.10),
    ("in backward, per parameter / foreach step", "adam-step", "in_backward", "foreach", None),
    ("in backward, bucketed / foreach step", "adam-step", "in_backward_bucketed", "foreach",
     1.10),
    ("ZeRO-2 on 2 gloo ranks / foreach step", "adam-step", "zero2", "foreach", None),
    ("ZeRO-2 step, hookbench / DeepSpeed stage 2", "zero2-peer", "hookbench", "deepspeed", 1.0),
    *((f"whole step {model}, {mode} / standard, {impl}", f"whole-step-{model}",
       f"{mode}-{impl}", f"standard-{impl}", 1.02)
      for model in ("vit_b_16", "transformer", "vit_l_16")
      for impl, modes in WHOLE_STEP_PAIRS.items()
      for mode in modes),
    ("capture, statistics rms+mean_abs / plain forward", "resnet18-capture",
     "stats_rms_mean_abs", "plain", 1.25),
    ("capture, all 8 statistics / plain forward", "resnet18-capture", "stats", "plain", None),
    ("capture, full tensors / plain forward", "resnet18-capture", "tensors", "plain", None),
)


def _ratios(benchmarks: list) -> list[dict]:
    stats = {(b.group, b.extra_info.get("device"),
              b.extra_info.get("strategy", b.extra_info.get("mode"))): b.stats
             for b in benchmarks if b and not b.has_error}
    return [{"ratio": label, "device": device, "target": target,
             "median": stats[group, device, slow].median / stats[group, device, fast].median,
             "min": stats[group, device, slow].min / stats[group, device, fast].min}
            for label, group, slow, fast, target in RATIOS for device in ("cpu", "cuda")
            if (group, device, slow) in stats and (group, device, fast) in stats]


def pytest_benchmark_update_json(config: pytest.Config, benchmarks: list, output_json: dict):
    """A saved run carries its ratios, so runs on other torch versions compare at a glance."""
    output_json["hookbench_ratios"] = _ratios(benchmarks)


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's table
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)
    rows = _ratios(session.benchmarks) if session is not None else []
    if not rows:
        return
    # Benchmarks run one after another, so on a shared machine a ratio also measures how the
    # machine's load changed in between; `hookbench gate` times the same pairs interleaved.
    terminalreporter.section("hookbench: benchmark ratios of this run (median; min)")
    for r in rows:
        target = "" if r["target"] is None else (
            f"  target <= {r['target']:.2f}x: {'met' if r['median'] <= r['target'] else 'MISSED'}")
        terminalreporter.write_line(f"{r['device']:4}  {r['ratio']:60} {r['median']:5.2f}x; "
                                    f"{r['min']:5.2f}x" + target)


def pytest_report_header(config: pytest.Config) -> list[str]:
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "not available"
    return [f"hookbench: torch {torch.__version__}, CUDA {cuda}"]


def _torchvision_missing() -> str | None:
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001 - absent, or built for another torch ("operator
        return f"{type(e).__name__}: {e}"  # torchvision::nms does not exist")
    return None


# A run that asks nothing of pytest-benchmark leaves the benchmarks out (deselected): they are
# the benchmark tier, `pytest --benchmark-only`, whose timings a test run on a shared machine
# would only spend time on. Any of these options brings them back.
_BENCHMARK_OPTIONS = ("benchmark_only", "benchmark_enable", "benchmark_disable", "benchmark_save",
                      "benchmark_autosave", "benchmark_compare", "benchmark_json",
                      "benchmark_histogram")


def _benchmarks_asked_for(config: pytest.Config) -> bool:
    return any(config.getoption(o, None) for o in _BENCHMARK_OPTIONS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # And --benchmark-only leaves out the rest, deselected rather than skipped one by one by
    # pytest-benchmark (a SKIPPED line each under -ra, about 116 in a passing run).
    only = config.getoption("benchmark_only", False)
    if only or not _benchmarks_asked_for(config):
        left_out = [i for i in items if ("benchmark" in getattr(i, "fixturenames", ())) != only]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [i for i in items if i not in left_out]
    # The one place that gates the GPU tier (@pytest.mark.gpu, @pytest.mark.gpu(count=2)) and
    # the tests of torchvision's models (@pytest.mark.torchvision; absent beside torch 2.13).
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = _torchvision_missing() if any(i.get_closest_marker("torchvision")
                                            for i in items) else None
    for item in items:
        if missing and item.get_closest_marker("torchvision"):
            item.add_marker(pytest.mark.skip(reason=f"needs torchvision, which does not import "
                                                    f"beside torch {torch.__version__}: {missing}"))
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.kwargs.get("count", 1)
        if available < needed:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {needed} CUDA device(s), found {available}"
                + ("" if torch.cuda.is_available() else " (torch.cuda.is_available() is False)")
            ))


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    """The block from seed 0 (torch's, numpy's and Python's global RNGs), each as it was after
    it (``hookbench.core.workload.seeded_rngs``)."""
    with seeded_rngs(0):
        yield


@pytest.fixture(scope="module")
def other_order() -> Iterator[None]:
    """The single-process references summed in another legal order than the ranks: computed on
    2 intra-op threads where each rank computes on 1 (``launch.RANK_THREADS``), whatever
    ``-n`` gave the worker. On 2 ranks the references otherwise do the ranks' arithmetic bit
    for bit; this is the drift more ranks make (another order of the sum), for the tests of
    what the judge does where DDP leaves the single process's tolerance (the yardstick
    cascade)."""
    before = torch.get_num_threads(), {n: os.environ.get(n) for n in _THREAD_VARIABLES}
    os.environ.update(dict.fromkeys(_THREAD_VARIABLES, "2"))
    torch.set_num_threads(2)
    patch = pytest.MonkeyPatch()
    patch.setattr(launch, "rank_threads", contextlib.nullcontext)
    try:
        yield
    finally:
        patch.undo()
        torch.set_num_threads(before[0])
        for name, value in before[1].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Runs that more than one test reads, each made once (issue 55, "CI does no work twice").
@pytest.fixture(scope="session")
def once(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], dict]], dict]:
    """``once(name, make)``: what ``make(folder)`` returns (a dict that JSON keeps), made once
    in this test session in a folder of its own, under pytest-xdist too: the first process to
    ask makes it while any other that asks meanwhile waits on a lock, then every one reads what
    it wrote, an error as well (RuntimeError, naming it). A session fixture alone runs once per
    worker, and ``--dist loadgroup``, which would keep its tests on one, groups nothing with
    pytest 9.2 (pytest-xdist#1386, open on xdist 3.8.0: it still writes the old node id)."""
    from filelock import FileLock  # torch's dependency

    base = tmp_path_factory.getbasetemp()  # a worker's is popen-gwN in the session's own
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "once"
    shared.mkdir(exist_ok=True)

    def get(name: str, make: Callable[[Path], dict]) -> dict:
        made = shared / f"{name}.json"
        with FileLock(str(shared / f"{name}.lock")):
            if not made.is_file():
                folder = shared / name
                folder.mkdir(exist_ok=True)
                try:
                    result = {"value": make(folder)}
                except Exception as e:  # noqa: BLE001 - every reader fails with it, none runs again
                    result = {"error": f"{type(e).__name__}: {e}"}
                made.write_text(json.dumps(result))
            result = json.loads(made.read_text())
        if "error" in result:
            raise RuntimeError(f"{name}, made once for this session: {result['error']}")
        return result["value"]

    return get


@pytest.fixture(scope="session")
def docs_samples() -> Iterator[ModuleType]:
    """docs/samples.py, the module that runs and checks the sample outputs of README.md and
    docs/: the one tests/test_samples.py loaded at collection, or loaded here (and unloaded
    after the session)."""
    path = Path(__file__).resolve().parent / "docs" / "samples.py"
    module = sys.modules.get("samples")
    if module is not None and Path(module.__file__).resolve() == path:
        yield module
        return
    spec = importlib.util.spec_from_file_location("samples", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["samples"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        if sys.modules.get("samples") is module:
            del sys.modules["samples"]


@pytest.fixture(scope="session")
def readme_report(docs_samples: ModuleType, once):
    """The README's ``hookbench report`` (ViT-L/16, every section; 142 s on one thread, about
    4 minutes on 2 loaded cores), made ``once`` in the session for the tests that read it: the
    README's and docs/report.md's samples (tests/test_samples.py) and what the command prints
    and writes (tests/cli/test_cli.py). Until issue 55 test_cli.py ran a report of its own, the
    transformer's (19.5 s on one thread), the slow tier's second. ``samples.Ran``: stdout,
    stderr and the folder ``{out}`` is in."""
    sample = docs_samples.SAMPLES["report"]
    return docs_samples.Ran(**once(
        "readme-report", lambda folder: dataclasses.asdict(docs_samples.ran(sample, folder))))


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from seed 0 and leaves the global RNGs as it found them."""
    with _seeded():
        yield


# The hook-leak guard. One tracker for the whole session weakly records every module and
# parameter built (from before collection on); each test, and each fixture of a wider scope,
# is a guard over it: a hook added during the test, or during the fixture's setup, must be gone
# when the test, or the fixture's teardown, ends (hookbench/core/leak_guard.py says what it can't
# see).
_HOOK_TRACKER = pytest.StashKey[HookTracker]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_HOOK_TRACKER] = HookTracker().install()


@pytest.hookimpl(trylast=True)  # after the last fixtures are torn down
def pytest_sessionfinish(session: pytest.Session) -> None:
    tracker = session.config.stash.get(_HOOK_TRACKER, None)
    if tracker is not None:
        tracker.uninstall()


def _fail_on_leaks(guard: HookLeakGuard, what: str) -> None:
    leaks = guard.leaks()
    guard.release()
    if leaks:
        pytest.fail(f"hooks left registered after {what}:\n  " + "\n  ".join(leaks),
                    pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    """A module-, class-, package- or session-scoped fixture sets up from seed 0, as a test
    does (torch seeds its generator at random in each process, and whatever ran before would
    decide its numbers), and removes, by the end of its teardown, the hooks it added in its
    setup; an error at that teardown names those left."""
    if fixturedef.scope == "function":  # the test's own seed and guard cover these
        return (yield)
    tracker = request.config.stash.get(_HOOK_TRACKER, None)
    with _seeded():
        if tracker is None:
            return (yield)
        guard = HookLeakGuard(tracker)
        # Added before the fixture's own teardown is, so it runs after it.
        request.addfinalizer(lambda: _fail_on_leaks(
            guard, f"the teardown of {fixturedef.scope}-scoped fixture '{fixturedef.argname}'"))
        try:
            with guard:
                return (yield)
        finally:
            guard.release()  # what the fixture returns stays alive through its teardown anyway


@pytest.fixture(autouse=True)
def _no_leaked_hooks(request: pytest.FixtureRequest):
    """Fail a test that leaves a hook it added registered: on a module or parameter it built, on
    one that a fixture or anything else built since the session started, or a global one."""
    with HookLeakGuard(request.config.stash.get(_HOOK_TRACKER, None)) as guard:
        yield
    _fail_on_leaks(guard, "the test")
