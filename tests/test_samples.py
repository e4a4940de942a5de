"""The sample outputs in README.md and docs/ against what their commands print now
(``docs/samples.py``): rows and counts, timings aside. The check itself is shown to fail on a
drifted sample and to pass a changed timing (default tier); running the commands is the slow
tier's (minutes: the report, the gate, zero2, and the Adafactor speed table where the ``hf``
extra is installed). Two runs are shared with other tests (issue 55: the slow
tier makes each once): the README's report is conftest.py's ``readme_report``, which
tests/cli/test_cli.py reads too, and examples/charlm's gate and its fault are checked by
tests/test_ci_recipes.py against the CI recipe's run of the same commands on a copy of
examples/charlm, not run here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "samples", Path(__file__).resolve().parent.parent / "docs" / "samples.py")
samples = importlib.util.module_from_spec(_spec)
sys.modules["samples"] = samples  # dataclasses look their module up
_spec.loader.exec_module(samples)

OUTPUT = """hookbench gate: torch 2.14.1

Hook contract
  check          verdict
  leaf_only      holds
  fires_once     holds
  ordered        holds (0.4 s)

Peak memory
  model/strategy  recorded  now
  mlp/foreach     1.0 MB    1.0 MB
! mlp/zero2       1.0 MB    2.0 MB

5 of 6 checks hold; 1 FAILED (marked !)
"""
SAMPLE = samples.Sample(("gate",), sections=("Hook contract",), rows=1, last=True)


def test_every_sample_is_shown_somewhere_and_every_marker_names_a_sample():
    where = samples.markers()
    assert set(where) == set(samples.SAMPLES), where
    assert "README.md" in where["report"] and "README.md" in where["gate"]


def test_a_sample_is_trimmed_to_its_sections_and_rows():
    assert samples.trim(SAMPLE, OUTPUT) == (
        "hookbench gate: torch 2.14.1\n\nHook contract\n  check          verdict\n"
        "  leaf_only      holds\n  ...\n  ordered        holds (0.4 s)\n\n"
        "5 of 6 checks hold; 1 FAILED (marked !)\n")
    failed = samples.Sample(("gate",), rows=r"!")
    assert "! mlp/zero2" in samples.trim(failed, OUTPUT)
    assert "mlp/foreach" not in samples.trim(failed, OUTPUT)


@pytest.mark.parametrize("change", [
    ("5 of 6 checks hold", "6 of 7 checks hold"),  # a count
    ("  fires_once     holds\n", ""),  # a row gone (rows=None keeps every row)
    ("leaf_only      holds", "leaf_only      VIOLATED"),  # a verdict
    ("  leaf_only", "  leaf_first"),  # a row renamed
])
def test_the_check_fails_on_a_drifted_sample(change):
    every_row = samples.Sample(("gate",))
    shown = samples.trim(every_row, OUTPUT).replace(*change)
    assert samples.drift(shown, samples.trim(every_row, OUTPUT))


def test_the_check_passes_a_changed_timing_or_checksum_and_rewrite_puts_the_sample_in_place():
    now = samples.trim(SAMPLE, OUTPUT)
    assert not samples.drift(now.replace("0.4 s", "12 s"), now)
    doc = "intro\n<!-- sample: gate -->\n```\nold\n```\nafter\n"
    assert samples.rewrite(doc, "gate", now) == (f"intro\n<!-- sample: gate -->\n```\n{now}```\n"
                                                 f"after\n")


def test_samples_that_share_a_run_are_one_group():
    groups = samples.runs()
    assert sorted(n for g in groups for n in g) == sorted(samples.SAMPLES)
    assert ["report", "report-full"] in groups
    assert ["charlm-gate", "charlm-gate-fault"] in groups


def test_less_written_takes_out_only_the_files_named():
    printed = ("56 of 64 checks hold; 8 FAILED (marked !)\nwrote out/gate.xml and out/gate.json "
               "and out/gate-failed.png\nbaseline: torch 2.14.1; GATE FAILED in workloads\n")
    ci = ["out/gate.xml", "out/gate.json"]
    assert samples.less_written(printed, ci) == printed.replace(
        "out/gate.xml and out/gate.json and ", "")
    clean = "64 of 64 checks hold\nwrote out/gate.xml and out/gate.json\nbaseline: GATE PASSED\n"
    assert samples.less_written(clean, ci) == "64 of 64 checks hold\nbaseline: GATE PASSED\n"
    assert samples.less_written(printed, []) == printed


# The project whose samples tests/test_ci_recipes.py checks, against the CI recipe's run on a
# copy of it (the same record and gate commands, with --junit-xml and --json besides): one
# record, gate and gate under the fault of examples/charlm in the slow tier, not two (issue 55).
CI_RECIPE_PROJECT = "examples/charlm"
# Groups whose run a fixture makes once in the session for this test and others (conftest.py),
# by their first sample.
SHARED = {"report": "readme_report"}
GROUPS = [pytest.param(names, id="+".join(names)) for names in samples.runs()
          if samples.SAMPLES[names[0]].cwd != CI_RECIPE_PROJECT]


def test_every_sample_is_checked_once_here_or_by_the_ci_recipe_test():
    here = [n for group in GROUPS for n in group.values[0]]
    there = [n for n, s in samples.SAMPLES.items() if s.cwd == CI_RECIPE_PROJECT]
    assert sorted(here + there) == sorted(samples.SAMPLES)
    assert there == ["charlm-gate", "charlm-gate-fault"]  # what tests/test_ci_recipes.py checks
    for name, fixture in SHARED.items():  # a shared run is the same command for its group
        group = next(g.values[0] for g in GROUPS if name in g.values[0])
        assert len({(s.argv, s.cwd, s.exit, s.before) for s in map(samples.SAMPLES.get, group)}
                   ) == 1, fixture


@pytest.mark.slow
@pytest.mark.parametrize("names", GROUPS)
def test_the_samples_print_what_the_commands_print_now(names, request):
    needs = {samples.SAMPLES[name].needs for name in names} - {None}
    missing = sorted(n for n in needs if importlib.util.find_spec(n) is None)
    if missing:
        pytest.skip(f"{', '.join(missing)} is not installed (the samples' optional extra)")
    if names[0] in SHARED:  # one command for the whole group (checked above)
        shared = request.getfixturevalue(SHARED[names[0]]).printed
        printed = dict.fromkeys(names, shared)
    else:
        printed = {name: samples.run(samples.SAMPLES[name]) for name in names}
    drifted = [d for name in names
               for d in samples.check(name, samples.trim(samples.SAMPLES[name], printed[name]))]
    assert not drifted, "\n".join(drifted)
