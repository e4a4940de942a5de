"""hookbench's pytest plugin (entry point ``pytest11``: active wherever hookbench is installed).

In your own test suite, the ``hookbench`` fixture checks your ``hookbench.Workload``s::

    from myproject.workloads import WORKLOAD

    def test_optimizer_in_backward_is_the_standard_step(hookbench):
        hookbench.assert_parity(WORKLOAD)          # every strategy against its reference

    def test_zero2_is_data_parallel_training(hookbench):
        hookbench.assert_zero2_parity(WORKLOAD)    # 2 gloo ranks, spawned with a timeout

    def test_memory(hookbench):
        peaks = hookbench.assert_memory(WORKLOAD, at_most={"in_backward": 2_000_000})

    def test_hook_contract(hookbench):
        hookbench.assert_hook_contract()           # the PyTorch behaviours they rely on

and ``pytest --hookbench-fault NAME`` runs the whole suite with that PyTorch fault injected
(``hookbench.measure.faults``), to prove that your checks fail when the hooks break.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from hookbench.core.workload import Workload

__all__ = ["Checks"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hookbench")
    # Validated in pytest_configure: importing the fault list here would import torch in
    # every pytest run of an environment that has hookbench installed.
    group.addoption("--hookbench-fault", default=None, metavar="NAME",
                    help="inject this PyTorch hook fault (hookbench.measure.faults) into every test; "
                         "the suite must then fail")


def pytest_configure(config: pytest.Config) -> None:
    fault = config.getoption("--hookbench-fault")
    if fault is not None:
        from hookbench.measure.faults import FAULTS

        if fault not in FAULTS:
            raise pytest.UsageError(f"--hookbench-fault {fault}: unknown fault; choose from "
                                    f"{', '.join(sorted(FAULTS))}")


def pytest_report_header(config: pytest.Config) -> list[str]:
    fault = config.getoption("--hookbench-fault")
    return [f"hookbench: FAULT INJECTED: {fault}"] if fault else []


@pytest.fixture(autouse=True, scope="session")
def _hookbench_fault(request: pytest.FixtureRequest):
    """The injected fault, session-wide, so that fixtures of any scope run under it too."""
    fault = request.config.getoption("--hookbench-fault")
    if fault is None:
        yield
        return
    from hookbench.measure.faults import inject

    with inject(fault):
        yield


class Checks:
    """What the ``hookbench`` fixture gives a test: assertions on a workload, each failing
    with the rows that did not hold (``hookbench.gate.workload_checks``). ``fault``: the one
    ``--hookbench-fault`` injects, passed on into spawned ranks."""

    def __init__(self, fault: str | None = None) -> None:
        self.fault = fault

    @staticmethod
    def _require(rows: dict[str, dict[str, Any]], what: str) -> dict[str, dict[str, Any]]:
        failed = [f"{key}: {'; '.join(row['problems']) if row.get('problems') else row['error']}"
                  for key, row in rows.items() if row.get("problems") or "error" in row]
        if failed:
            pytest.fail(f"{what}:\n  " + "\n  ".join(failed), pytrace=False)
        return rows

    def assert_parity(self, workload: Workload) -> dict[str, dict[str, Any]]:
        """Every strategy trains ``workload`` like its reference (the optimizer in backward,
        per parameter and grouped, bit for bit like the for-loop step; grouped foreach and
        bucketed within tolerance of foreach), or refuses it by design (the optimizer in
        backward with fp16 or gradient clipping). Returns the rows."""
        from hookbench.gate import workload_checks

        return self._require(workload_checks.trajectories(workload),
                             f"{workload.name}: a strategy does not train like its reference")

    def assert_zero2_parity(self, workload: Workload) -> dict[str, Any]:
        """ZeRO-2 on 2 spawned gloo ranks trains ``workload`` like torch's DDP on the same
        shares (bit for bit where the arithmetic is the same) and like the for-loop step on
        the ranks' shares in one process (within the derived tolerance, or the measured noise
        floor where DDP itself exceeds it), frees every gradient, runs every hook once; or
        refuses the optimizer in words (``{"refused": ...}``). From the same launch, the
        engines' rows (``<name>/engines/<engine>``: DDP, FSDP2 as ZeRO-2 and ZeRO-3, the
        optimizer in backward under FSDP2; ``hookbench.engines.verdicts``) must hold too, or
        say why they do not apply. Returns all the rows."""
        from hookbench.gate import workload_checks

        return self._require(workload_checks.zero2([workload], self.fault),
                             f"{workload.name}: ZeRO-2 does not train like data parallelism")

    def assert_memory(self, workload: Workload,
                      at_most: dict[str, int] | None = None) -> dict[str, int]:
        """One step's peak per strategy on the fake backend (bytes, as the CUDA allocator
        would round them; on real CPU tensors where fake ones cannot run the model): the optimizer in backward no higher than the standard step, no
        strategy but the standard one holding every gradient at once, and each peak within
        ``at_most`` (strategy -> bytes). Returns the peaks."""
        from hookbench.gate import workload_checks

        rows = self._require(workload_checks.memory(workload),
                             f"{workload.name}: the memory of a strategy regressed")
        peaks = {key.rsplit("/", 1)[1]: row["peak"] for key, row in rows.items()}
        unknown = set(at_most or {}) - set(peaks)
        if unknown:
            raise ValueError(f"at_most names {sorted(unknown)}; measured {sorted(peaks)}")
        over = [f"{s}: peak {peaks[s]:,} B > at most {bound:,} B"
                for s, bound in (at_most or {}).items() if peaks[s] > bound]
        if over:
            pytest.fail(f"{workload.name}: peak memory above its bound:\n  " + "\n  ".join(over),
                        pytrace=False)
        return peaks

    def assert_capture(self, workload: Workload) -> dict[str, Any]:
        """``ActivationCapture`` on ``workload``'s training forward changes neither the loss
        nor any gradient, records one output per module call and leaves no hook behind."""
        from hookbench.gate import workload_checks

        return self._require(workload_checks.capture(workload),
                             f"{workload.name}: activation capture changed the training step")

    def assert_transform(self, workload: Workload) -> dict[str, Any]:
        """The workload's checkpointing (its own, or the model's ``gradient_checkpointing_
        enable``) and offload change neither the loss nor any gradient of one step, bit for
        bit; {} where it has neither."""
        from hookbench.gate import workload_checks

        return self._require(workload_checks.transform(workload),
                             f"{workload.name}: a memory-saving transform changed the step")

    def assert_hook_contract(self) -> None:
        """Every PyTorch hook behaviour the mechanisms rely on holds
        (``hookbench.measure.hook_contract``)."""
        from hookbench.measure import hook_contract

        violated = [f"{name}: {error}" for name, error in hook_contract.run_all().items()
                    if error is not None]
        if violated:
            pytest.fail("the hook contract is violated:\n  " + "\n  ".join(violated),
                        pytrace=False)


@pytest.fixture
def hookbench(request: pytest.FixtureRequest) -> Checks:
    """Assertions on your workloads: parity, ZeRO-2 parity, memory, the hook contract."""
    return Checks(request.config.getoption("--hookbench-fault"))
