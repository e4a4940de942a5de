"""The gate's ``hooks`` section: every hook-contract check (``hookbench.measure.hook_contract``)
has its recorded outcome. A check that newly fails, or newly holds, is a changed row."""

from __future__ import annotations

from typing import Any

from hookbench.gate.checks import Run, Section, contract_rows
from hookbench.measure import hook_contract

FAULTS = None  # selfcheck runs it under every fault


def measure(run: Run) -> dict[str, Any]:
    return hook_contract.run_all()


def judge(base: dict, now: dict, run: Run) -> Section:
    return contract_rows("Hook behaviour (hook contract) against the baseline", base, now)
