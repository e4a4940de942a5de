"""The verdicts as files that CI reads: JUnit XML (GitHub Actions, GitLab and Jenkins list a
failed test case from it) and JSON (for scripts), written by ``hookbench gate`` and ``hookbench
report`` with ``--junit-xml PATH`` and ``--json PATH``.

A section is a test suite, a row a test case: a FAILED row a ``<failure>`` whose message is
the row's own words, a SKIPPED row ``<skipped>`` with its reason. The JSON has every row:
section, name, verdict (pass, fail, skipped), recorded and now (the gate's stored and new
measurement of that row, its final parameters left out: the baseline file holds them), the
detail (the row's words) and its cells by column. Both files say which torch made them, and
are written whole or not at all (a temporary file renamed)."""

from __future__ import annotations

import datetime
import json
import platform
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

from hookbench.gate.baselines import write_atomically
from hookbench.gate.checks import Section, Verdict

__all__ = ["rows", "write_json", "write_junit"]


def _name(section: Section, cells: tuple[str, ...]) -> str:
    """The row's name: its leading ``Section.key_columns`` cells."""
    return " / ".join(cells[:section.key_columns])


def _message(section: Section, cells: tuple[str, ...]) -> str:
    """A failed row's words: the cells between its name and its verdict (recorded, now, ...),
    then the verdict."""
    between = [f"{column} {cell}" for column, cell in
               zip(section.columns[section.key_columns:-1], cells[section.key_columns:-1]) if cell]
    return ": ".join(filter(None, ("; ".join(between), cells[-1])))


def _compact(value: Any) -> Any:
    """A measurement without its final parameters (``final``: every element of every tensor;
    the baseline holds them, a checksum names them)."""
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items() if k != "final"}
    return value


def rows(sections: dict[str, Section], base: dict[str, Any] | None = None,
         now: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every row of ``sections`` (by name: the gate's section names, or the report's titles) as
    a dict; ``base`` and ``now``: the gate's baseline and measurement, by section and row."""
    out = []
    for key, section in sections.items():
        for cells, verdict in section.rows:
            name = _name(section, cells)
            out.append({
                "section": key, "title": section.title, "name": name,
                "verdict": verdict.value,
                "recorded": _compact((base or {}).get(key, {}).get(name)),
                "now": _compact((now or {}).get(key, {}).get(name)),
                "detail": cells[-1],
                "cells": dict(zip(section.columns, cells))})
    return out


def write_json(path: Path, command: str, sections: dict[str, Section],
               base: dict[str, Any] | None = None, now: dict[str, Any] | None = None,
               **about: Any) -> Path:
    """``rows`` and ``about`` (the baseline's torch, ...) as JSON at ``path``."""
    data = {"command": command, "torch": torch.__version__, **about,
            "ok": all(s.ok for s in sections.values()),
            "rows": rows(sections, base, now)}
    write_atomically(path, json.dumps(data, indent=1, default=str) + "\n")
    return path


def write_junit(path: Path, command: str, sections: dict[str, Section], seconds: float,
                **about: str) -> Path:
    """One ``<testsuite>`` per section, one ``<testcase>`` per row, at ``path``; ``about``
    becomes each suite's properties (torch: the installed one, and what the caller adds)."""
    suites = ET.Element("testsuites", name=command)
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    properties = {"torch": torch.__version__, **about}
    for key, section in sections.items():
        counts = {"tests": len(section.rows), "failures": sum(
            v is Verdict.FAIL for _, v in section.rows), "errors": 0, "skipped": section.skipped}
        for what, n in counts.items():
            totals[what] += n
        suite = ET.SubElement(suites, "testsuite", name=key, timestamp=stamp,
                              hostname=platform.node(), **{k: str(n) for k, n in counts.items()})
        listed = ET.SubElement(suite, "properties")
        for name, value in {"title": section.title, **properties}.items():
            ET.SubElement(listed, "property", name=name, value=str(value))
        for cells, verdict in section.rows:
            case = ET.SubElement(suite, "testcase", name=_name(section, cells),
                                 classname=f"{command.replace(' ', '.')}.{key}")
            if verdict is Verdict.FAIL:
                ET.SubElement(case, "failure", type="FAILED",
                              message=_message(section, cells)).text = "\n".join(
                    f"{column}: {cell}" for column, cell in zip(section.columns, cells))
            elif verdict is Verdict.SKIPPED:
                ET.SubElement(case, "skipped", message=cells[-1].removeprefix("SKIPPED: "))
    # the schema has no skipped count on <testsuites>, only on each <testsuite>
    suites.attrib.update({k: str(n) for k, n in totals.items() if k != "skipped"},
                         time=f"{seconds:.3f}")
    ET.indent(suites)
    write_atomically(path, '<?xml version="1.0" encoding="utf-8"?>\n'
           + ET.tostring(suites, encoding="unicode") + "\n")
    return path
