"""The warnings section: each mechanism's run records its warnings stably, and the gate lists new
and vanished ones, failing on them only under --strict-warnings (a run that raises always fails)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hookbench import gate
from hookbench.gate import baselines, emitted_warnings
from hookbench.measure.faults import inject
from hookbench.report import render

BASELINE = Path(__file__).resolve().parents[2] / "baselines" / "gate.json"


@pytest.fixture(scope="module")
def base():
    return baselines.load(BASELINE)


@pytest.fixture(scope="module")
def emitted():
    return emitted_warnings.run_all()


def _section(base, now, strict):
    return gate.check(base, {"recorded_with": baselines.environment(), "warnings": now},
                      parity=False, strict_warnings=strict)["warnings"]


def test_every_run_emits_the_recorded_warnings(base, emitted):
    assert set(emitted) == set(emitted_warnings.RUNS) == set(base["warnings"])
    # hookbench's own mechanisms warn about nothing, on every release measured (2.4.1-2.15.0)
    assert {run: w for run, w in emitted.items() if w and not run.startswith("checkpoint")} == {}
    assert _section(base, emitted, strict=False).ok
    if base["recorded_with"]["torch"] == torch.__version__:  # other releases word them
        section = _section(base, emitted, strict=True)     # differently (docs/releases.md)
        assert section.ok, render([section])
        assert all(cells[-1] == "as recorded" for cells, _ in section.rows)


def test_the_use_reentrant_warning_is_recorded_where_it_is_live(emitted):
    # pytorch#100551..#160534: checkpoint() without use_reentrant warns on torch 2.4 to 2.15.
    assert any("use_reentrant parameter should be passed explicitly" in w
               for w in emitted["checkpoint_use_reentrant_unset"])
    assert not any("use_reentrant" in w for w in emitted["checkpoint_use_reentrant_false"])


def test_a_description_masks_numbers_and_line_numbers_and_keeps_the_source():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (3, 1234567, 2.5e-07):
            warnings.warn_explicit(f"bucket of {n} at 0xdeadBEEF  in\nrelease 2.15",
                                   DeprecationWarning, emitted_warnings.__file__, int(n) + 1)
    described = {emitted_warnings.describe(w) for w in caught}
    assert described == {"DeprecationWarning: bucket of # at # in release # "
                         "(hookbench/gate/emitted_warnings.py)"}


def test_a_new_warning_is_listed_and_fails_only_when_strict(base, emitted):
    # Against what this torch emits without the fault (the committed baseline is another
    # torch's under tox -e torch24 ...).
    base = {**base, "warnings": emitted}
    with inject("new_warning"):
        now = emitted_warnings.run_all()
    lenient, strict = _section(base, now, False), _section(base, now, True)
    assert lenient.ok and not strict.ok
    new = {cells[0] for cells, ok in strict.rows if not ok}
    # Every mechanism that registers a forward hook (ZeRO-2 and OptimizerInBackward refuse a
    # reentrant checkpoint through one) shows it; the checkpoint runs register none.
    assert new == {"activation_capture", "optimizer_in_backward",
                   "optimizer_in_backward_grouped_foreach", "zero2_one_rank"}
    assert all(cells[-1] == "NEW" and "FutureWarning: Module.register_forward_hook will change"
               in cells[1] for cells, ok in strict.rows if not ok)


def test_a_vanished_warning_is_listed_and_fails_only_when_strict(base, emitted):
    recorded = {**base, "warnings": {**emitted, "activation_capture": [
        "UserWarning: a warning this release no longer emits (torch/nn/modules/module.py)"]}}
    lenient, strict = _section(recorded, emitted, False), _section(recorded, emitted, True)
    assert lenient.ok and not strict.ok
    (cells, _), = [row for row in strict.rows if not row[1]]
    assert cells[0] == "activation_capture" and cells[-1] == "VANISHED"


def test_a_run_that_raises_fails_even_when_not_strict(base, monkeypatch):
    def broken() -> None:
        raise RuntimeError("the mechanism refused")

    monkeypatch.setitem(emitted_warnings.RUNS, "activation_capture", broken)
    section = _section(base, emitted_warnings.run_all(), False)
    failed = [cells for cells, ok in section.rows if not ok]
    assert failed == [("activation_capture", "", "FAILED: RuntimeError: the mechanism refused")]


def test_run_all_leaves_the_warning_filters_and_no_process_group(emitted):
    before = list(warnings.filters)
    emitted_warnings.run_all()
    assert warnings.filters == before and not dist.is_initialized()
