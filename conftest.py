"""hookbench's pytest configuration: tiers, profiles, seeding and the hook-leak guard.

Test tiers (markers are registered in pyproject.toml and enforced with --strict-markers):

    pytest                              everything this machine can run (GPU tests skip), < 5 min
    pytest -m "not slow"                the quick loop while developing
    pytest -m gpu                       the GPU tier; needs CUDA, each test skips with a reason
    pytest -m distributed               tests that spawn torch.distributed worker processes
    pytest --hypothesis-profile thorough    property tests with many more examples
    pytest --benchmark-only             only the pytest-benchmark benchmarks
    pytest --benchmark-compare          compare with the newest run stored in baselines/benchmarks
    pytest --hookbench-fault NAME       run the suite with a PyTorch hook fault injected; it must fail

Hypothesis profiles: ``ci`` (derandomized, no deadline, moderate examples; the default when the
CI variable is set), ``dev`` (the default otherwise: fewer examples), ``thorough``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from hookbench.faults import FAULTS, inject
from hookbench.leak_guard import HookLeakGuard

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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--hookbench-fault", choices=sorted(FAULTS), default=None,
        help="inject this PyTorch hook fault into every test; the suite must then fail",
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark opens its storage
def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--hookbench-fault"):
        settings.load_profile("fault")
    # pytest-benchmark stores runs in ./.benchmarks relative to the current directory; the
    # committed baselines live in baselines/benchmarks, wherever pytest is started from.
    if config.getoption("benchmark_storage", None) == "file://./.benchmarks":
        config.option.benchmark_storage = f"file://{config.rootpath / 'baselines' / 'benchmarks'}"


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """Stored benchmark runs say which torch, CUDA and GPU they ran on."""
    machine_info["torch"] = torch.__version__
    machine_info["cuda"] = torch.version.cuda
    machine_info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None


def pytest_report_header(config: pytest.Config) -> list[str]:
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "not available"
    lines = [f"hookbench: torch {torch.__version__}, CUDA {cuda}"]
    fault = config.getoption("--hookbench-fault")
    if fault:
        lines.append(f"hookbench: FAULT INJECTED: {fault}")
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The one place that gates the GPU tier: @pytest.mark.gpu or @pytest.mark.gpu(count=2).
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.kwargs.get("count", 1)
        if available < needed:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {needed} CUDA device(s), found {available}"
                + ("" if torch.cuda.is_available() else " (torch.cuda.is_available() is False)")
            ))


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from seed 0 and leaves the global RNGs as it found them."""
    torch_state, py_state = torch.random.get_rng_state(), random.getstate()
    torch.manual_seed(0)
    random.seed(0)
    try:
        yield
    finally:
        torch.random.set_rng_state(torch_state)
        random.setstate(py_state)


@pytest.fixture(autouse=True)
def _no_leaked_hooks():
    """Fail a test that leaves a module, tensor or global hook registered, naming each."""
    guard = HookLeakGuard()
    with guard:
        yield
    leaks = guard.leaks()
    guard.release()
    if leaks:
        pytest.fail("hooks left registered after the test:\n  " + "\n  ".join(leaks))


@pytest.fixture(autouse=True)
def _injected_fault(request: pytest.FixtureRequest):
    with inject(request.config.getoption("--hookbench-fault")):
        yield
