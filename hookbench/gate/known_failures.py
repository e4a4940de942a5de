"""Known failures: what failed on the torch a baseline was recorded on, kept with its words.

A team on a release with a real bug (gloo's reduce-scatter on torch 2.4.1, an engine that breaks
on one model) still needs a baseline to gate its upgrade against. So ``hookbench record`` writes
every row that failed as it is, and lists it under ``KEY`` with its words (``of``); the gate
then compares such a row like with like (``judge``):

    the same failure now          holds: "known failure, unchanged since the baseline"
    the row passes now            holds, reported: "FIXED since the baseline"; there is nothing
                                  recorded to hold its values to, so record again to gate them
    another failure now           FAILED: "CHANGED failure", recorded words against now's
    not measured now              FAILED, as any recorded row that is not measured

"The same" is the same words with every number masked (inf and nan too), and every source path
from where torch's own tree starts: a failure that moves from 5.4e-07 to 5.6e-07 is the same
failure, and so is a C++ assert raised at reducer.cpp:1634 of a build in /pytorch and at
reducer.cpp:1732 of one in /__w/pytorch/pytorch (pytorch#143580 on 2.9.1 and 2.14.1), or at
../torch/csrc/distributed/c10d/reducer.cpp:1603 (2.5.1); one that
names another parameter, row or exception is not. A
section whose whole measurement crashed is one failure, keyed ``CRASHED``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["CRASHED", "KEY", "judge", "listed", "of", "same", "words"]

KEY = "known_failures"  # the baseline's table: section -> row key -> words
CRASHED = "crashed"  # the key of a section whose measurement as a whole raised
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|\b(inf|nan)\b")
# a path up to torch's tree (torch/, aten/, c10/): where that build was made ("/pytorch/",
# "/__w/pytorch/pytorch/", "../" on 2.5.1)
_BUILD_TREE = re.compile(r"(?<=[\"' (])[^\"' ]*?/(?=(torch|aten|c10)/)")


def words(value: Any) -> str | None:
    """What a measured row failed on (an exception it raised, the problems it found, a
    collective's silently wrong result: gloo's reduce-scatter on 2.4.1), or None for a row
    that holds."""
    if isinstance(value, str) and value.startswith("WRONG"):  # a collective's outcome
        return value
    if not isinstance(value, dict):
        return None
    if "error" in value:
        return value["error"]
    return "; ".join(value["problems"]) if value.get("problems") else None


def of(measured: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Section -> row key -> words: every row of ``measured`` (``gate.measure_all``) that
    failed, and every section whose measurement crashed (key ``CRASHED``)."""
    found: dict[str, dict[str, str]] = {}
    for section, rows in measured.items():
        if section in ("recorded_with", "device", KEY) or not isinstance(rows, dict):
            continue
        failed = {key: (rows[key] if key == CRASHED else words(value))
                  for key, value in rows.items()}
        failed = {key: w for key, w in failed.items() if w}
        if failed:
            found[section] = failed
    return found


def listed(known: dict[str, dict[str, str]]) -> list[str]:
    """``section/key: words``, one per known failure."""
    return [f"{section}{'' if key == CRASHED else '/' + key}: {w}"
            for section, rows in known.items() for key, w in rows.items()]


def same(recorded: str, now: str) -> bool:
    """The same failure: the same words, numbers and build paths aside."""
    return _masked(recorded) == _masked(now)


def _masked(text: str) -> str:
    return _NUMBER.sub("#", _BUILD_TREE.sub("", text))


def judge(recorded: dict[str, str], now: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(row key, holds, verdict) for each known failure of one section: ``recorded`` its
    recorded words by key, ``now`` the section's rows measured now."""
    out = []
    for key, was in recorded.items():
        if key == CRASHED:
            failed = now.get(CRASHED)
        elif key not in now:
            out.append((key, False, f"recorded as a known failure ({was}), but not measured "
                                    f"now (re-record on purpose)"))
            continue
        else:
            failed = words(now[key])
        if failed is None:
            out.append((key, True, f"FIXED since the baseline: it failed there ({was}) and "
                                   f"holds now; record again to gate its values"))
        elif same(was, failed):
            out.append((key, True, f"known failure, unchanged since the baseline: {failed}"))
        else:
            out.append((key, False, f"CHANGED failure: recorded {was}; now {failed}"))
    return out
