"""The collectives of sharded training against a hand computation on 2 and 3 gloo ranks, and
the upgrade gate's collectives section: a silently wrong result always fails, a changed outcome
fails, a newly supported pair passes saying so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hookbench import gate
from hookbench.gate import baselines, collectives

BASELINE = Path(__file__).resolve().parents[2] / "baselines" / "gate.json"
NOT_SUM = ("AVG", "MAX", "MIN", "PRODUCT")
# gloo's reduce_scatter summed whatever op it was given until torch 2.9 (pytorch#162338; seen
# on 2.4.1 to 2.8.0, right on 2.9.1 on), and gloo had no AVG before 2.8 (pytorch#149781; seen
# on 2.4.1 to 2.7.1). The matrix pins both; a new wrong pair, or a fixed one, fails this test.
KNOWN_WRONG = ({f"{w} ranks/reduce_scatter_tensor/{op}" for w in collectives.WORLDS
                for op in NOT_SUM} if torch.__version__ < (2, 9) else set())
KNOWN_UNSUPPORTED = ({f"{w} ranks/{c}/AVG" for w in collectives.WORLDS
                      for c in ("all_reduce", "reduce")} if torch.__version__ < (2, 8) else set())

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def base():
    return baselines.load(BASELINE)


# 3 ranks slow: about 8 s more; 2 ranks already show a reduce-scatter that ignores its op
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_pair_matches_the_hand_computation(request, world):
    # The suite's injected fault (--hookbench-fault) goes into the ranks, as for ZeRO-2.
    outcomes = collectives.run_matrix(request.config.getoption("--hookbench-fault"),
                                      worlds=(world,))
    here = f"{world} ranks/"
    assert {k for k, v in outcomes.items() if v.startswith("WRONG")} == {
        k for k in KNOWN_WRONG if k.startswith(here)}, outcomes
    assert {k for k, v in outcomes.items() if v.startswith("unsupported")} == {
        k for k in KNOWN_UNSUPPORTED if k.startswith(here)}
    # Every collective the installed torch has, each op.
    assert len(outcomes) == len(collectives.pairs()) and all(k.startswith(here) for k in outcomes)


# slow: about 8 s; under this fault the default tier fails every_pair_matches_the_hand_computation
# (tests/measure/test_faults.py) and selfcheck (slow) fails the gate
@pytest.mark.slow
def test_the_gate_fails_a_reduce_scatter_that_ignores_op(base):
    now = {"recorded_with": baselines.environment(),
           "collectives": collectives.run_matrix("reduce_scatter_ignores_op")}
    section = gate.check(base, now, parity=False)["collectives"]
    failed = {cells[0]: cells[-1] for cells, ok in section.rows if not ok}
    names = [n for n in ("reduce_scatter_tensor", "reduce_scatter_single")
             if hasattr(torch.distributed, n)]
    assert set(failed) == {f"{w} ranks/{n}/{op}" for w in collectives.WORLDS for n in names
                           for op in NOT_SUM}
    assert all(v.startswith("WRONG") and v.endswith("(a silently wrong result)")
               for v in failed.values())
    assert failed["2 ranks/reduce_scatter_tensor/MAX"].startswith(
        "WRONG: rank 0 holds [3.0, 6.0, 9.0], expected [2.0, 4.0, 6.0]")


def test_outcome_changes_against_the_baseline():
    base = {"recorded_with": baselines.environment(),
            "collectives": {"2 ranks/a": "ok", "2 ranks/b": "unsupported: RuntimeError: no AVG",
                            "2 ranks/c": "ok", "2 ranks/d": "ok", "2 ranks/e": "WRONG: x"}}
    now = {"recorded_with": base["recorded_with"],
           "collectives": {"2 ranks/a": "ok", "2 ranks/b": "ok",
                           "2 ranks/c": "unsupported: RuntimeError: gone", "2 ranks/e": "WRONG: x"}}
    section = gate.check(base, now, parity=False)["collectives"]
    rows = {cells[0]: (bool(ok), cells[-1]) for cells, ok in section.rows}
    assert rows["2 ranks/a"] == (True, "identical")
    assert rows["2 ranks/b"] == (True, "newly supported (was unsupported: RuntimeError: no AVG)")
    assert rows["2 ranks/c"] == (False, "CHANGED: unsupported: RuntimeError: gone")
    # A collective the installed torch lacks (reduce_scatter_single before 2.13): SKIPPED,
    # naming it.
    assert rows["2 ranks/d"] == (True, f"SKIPPED: torch {torch.__version__} has no "
                                       "torch.distributed.d")
    assert section.skipped == 1
    assert rows["2 ranks/e"] == (False, "WRONG: x (a silently wrong result)")  # even if recorded so
