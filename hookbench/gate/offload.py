"""The gate's ``offload`` section: activation offload through saved-tensor hooks
(``hookbench.measure.saved_tensor_contract``). The saved-tensor-hook behaviours it relies on
against the baseline; lossless offload bit for bit per strategy and each compression within its
bound, live; and the transformer's in-backward step with offload, its device and host peak
against the baseline."""

from __future__ import annotations

from typing import Any

from hookbench.gate.checks import Run, Section, contract_rows
from hookbench.gate.memory import amount, memory_verdict
from hookbench.measure import saved_tensor_contract

# The faults selfcheck runs it under (about 3 s each): the saved-tensor hooks' and offload's
FAULTS = ("pack_called_twice", "unpack_returns_stale", "offload_keeps_device_copy",
          "compression_on_exact_tensor", "checkpoint_forgets_rng_state")
CONTRACT = "contract/"  # the key prefix of the saved-tensor-hook behaviours' rows


def measure(run: Run) -> dict[str, Any]:
    return {**{CONTRACT + k: v for k, v in saved_tensor_contract.run_all().items()},
            **saved_tensor_contract.offload_rows()}


def judge(base: dict, now: dict, run: Run) -> Section:
    def contract(rows: dict) -> dict:
        return {k: v for k, v in rows.items() if k.startswith(CONTRACT)}

    section = contract_rows("Activation offload: saved-tensor hooks against the baseline, the "
                            "mechanism live, its memory against the baseline",
                            contract(base), contract(now))
    for key, value in now.items():
        if key.startswith(CONTRACT) or section.add_stopped(value, key):
            continue
        if "peak" in value:  # the fake backend counts exactly: device and host as recorded
            rec = base.get(key)
            ok, verdict = memory_verdict(rec, value, "fake")
            host = rec is not None and rec.get("host_peak") == value["host_peak"]
            section.add(ok and host, key, "", f"peak {amount(value['peak'])}, host "
                        f"{amount(value['host_peak'])}: {verdict}" + (
                            "" if host else f"; host CHANGED (recorded "
                            f"{'nothing' if rec is None else amount(rec['host_peak'])})"))
        else:
            section.add(value["ok"], key, "", value["verdict"])
    return section
