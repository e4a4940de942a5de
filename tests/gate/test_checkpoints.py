"""Checkpoints across releases: the committed files (baselines/checkpoints/, written by the
baseline torch) load and resume as recorded, and the gate's checkpoint section fails when a
release changes the schema (``step``'s dtype, a renamed key), the continuation, or the files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hookbench import gate
from hookbench.gate import baselines, checkpoints
from hookbench.measure.faults import inject
from hookbench.report import render

BASELINE = Path(__file__).resolve().parents[2] / "baselines" / "gate.json"
FOLDER = baselines.checkpoint_folder(BASELINE)


def _judge(base, now):
    return gate.check(base, {"recorded_with": baselines.environment(), **now}, parity=False)


@pytest.fixture(scope="module")
def base():
    return baselines.load(BASELINE)


@pytest.fixture(scope="module")
def resumed():
    # In-process variants only: the sharded ZeRO-2 rows start 2 ranks, checked once below.
    return checkpoints.resume(FOLDER, ranks=False)


def _failed(base, now) -> dict[str, str]:
    section = _judge(base, {"checkpoints": now})["checkpoints"]
    return {cells[0]: cells[-1] for cells, ok in section.rows if not ok}


def test_every_family_and_variant_is_committed_and_recorded(base):
    expected = {f"{family}/{variant}" for family in checkpoints.FAMILIES
                for variant in checkpoints.VARIANTS}
    assert set(base["checkpoints"]) == expected
    files = {p.name for p in FOLDER.glob("*.pt")}
    assert "adam-zero2_sharded-rank1.pt" in files and "adamw-zero2_gathered.pt" in files
    assert len(files) == len(checkpoints.FAMILIES) * 5  # standard, in_backward, 2 ranks, gathered


def test_the_committed_checkpoints_resume_as_recorded(base, resumed):
    section = _judge(base, {"checkpoints": resumed})["checkpoints"]
    assert section.ok, render([section])
    # same kernels: bit for bit
    if baselines.same_kernels(base["recorded_with"], baselines.environment()):
        assert all("continuation identical" in cells[-1] for cells, _ in section.rows)


# slow: 2 ranks, about 6 s; the default tier resumes every other committed file
# (committed_checkpoints_resume), and the gate's checkpoints section resumes these too
@pytest.mark.slow
@pytest.mark.distributed
def test_the_sharded_zero2_checkpoints_resume_on_2_ranks_as_recorded(base):
    now = checkpoints.resume(FOLDER, families=("adam", "sgd"))
    sharded = {k: v for k, v in now.items() if k.endswith("zero2_sharded")}
    assert set(sharded) == {"adam/zero2_sharded", "sgd/zero2_sharded"}
    assert not _failed(base, sharded)


def test_the_schema_names_what_history_changed():
    # The places pytorch#110940/#115841 (step's dtype), #134107 (param_names) and #143710
    # (AdamW's decoupled_weight_decay) changed are lines of the schema.
    saved = torch.load(FOLDER / "adamw-in_backward.pt", weights_only=True)
    lines = checkpoints.schema(saved)
    assert "optimizer.state.step: tensor float32 cpu scalar" in lines
    assert "optimizer.param_groups[0].param_names: list" in lines
    assert "optimizer.state of parameters [2, 3, 4, 5, 6]" in lines  # the frozen layer: none
    if issubclass(torch.optim.AdamW, torch.optim.Adam):
        assert "optimizer.param_groups[0].decoupled_weight_decay: bool" in lines


def test_a_step_loaded_as_another_dtype_fails_though_the_arithmetic_is_identical(base):
    with inject("step_dtype_changed"):
        now = checkpoints.resume(FOLDER, families=("adam",), ranks=False)
    failed = _failed(base, now)
    # A legacy Python-number step is made a tensor by Adam.__setstate__, not by the loading
    # policy the fault changes.
    assert set(failed) == set(now) - {"adam/legacy_step"}
    for verdict in failed.values():
        assert ("schema saved after resuming CHANGED: - optimizer.state.step: tensor float32 "
                "cpu scalar; + optimizer.state.step: tensor float64 cpu scalar") in verdict
        # the numbers alone would pass: bit for bit where the baseline's kernels are these;
        # on another CPU within tolerance, or bit for bit where its kernels round alike (an
        # AMD EPYC AVX512 did, against the Xeon the baseline was recorded on)
        same = baselines.same_kernels(base["recorded_with"], baselines.environment())
        assert re.search("final parameters bit-exact" if same else
                         "final parameters (bit-exact|ok)", verdict), verdict


def test_a_renamed_key_fails_naming_both_names(base, resumed):
    with inject("checkpoint_key_renamed"):
        now = checkpoints.resume(FOLDER, families=("sgd",), ranks=False)
    failed = _failed(base, now)
    assert set(failed) == set(now)
    assert all("- optimizer.param_groups[0].weight_decay: float; + optimizer.param_groups[0]."
               "weight_decay_rate: float" in v for v in failed.values())


def test_a_changed_continuation_fails_and_a_changed_file_schema_fails(base, resumed):
    with inject("optimizer_arithmetic_changed"):
        now = checkpoints.resume(FOLDER, families=("adam",), ranks=False)
    failed = _failed(base, now)
    assert set(failed) == set(now) and all("x of tolerance" in v for v in failed.values())
    # A file whose schema differs from the recorded one: a key the baseline torch did not save.
    renamed = {**resumed["sgd/standard"], "schema": [*resumed["sgd/standard"]["schema"], "x"]}
    assert "file schema CHANGED: + x" in _failed(base, {"sgd/standard": renamed})["sgd/standard"]


def test_missing_files_fail_naming_the_file_not_skip(base, tmp_path):
    now = checkpoints.resume(tmp_path, families=("sgd",), ranks=False)
    section = _judge(base, {"checkpoints": now})["checkpoints"]
    assert not section.ok and section.skipped == 0
    for cells, _ in section.rows:
        assert cells[-1].startswith("FAILED: FileNotFoundError") and "sgd-" in cells[-1]


@pytest.mark.slow  # hookbench record end to end; test_workload records a user's baseline too
def test_record_writes_the_files_beside_the_baseline(tmp_path):
    # (and only when every measurement succeeded: test_gate.py's refusal test)
    from hookbench.cli import main

    target = tmp_path / "gate.json"
    assert main(["record", "--baseline", str(target), "--sections", "checkpoints"]) == 0
    written = sorted(p.name for p in baselines.checkpoint_folder(target).glob("*.pt"))
    assert written == sorted(p.name for p in FOLDER.glob("*.pt"))
    assert main(["gate", "--baseline", str(target), "--sections", "checkpoints"]) == 0


def test_checkpoints_written_by_torch_2_4_1_resume_here_as_they_did_there():
    # The upgrade direction, as test_can_load_older_state_dict in PyTorch's test_optim.py:
    # files the floor release wrote (baselines/checkpoints/torch2.4.1/, with what resuming
    # them did on 2.4.1) resume on the installed torch to the same parameters. The one schema
    # change on 2.14.1: Adam's and AdamW's groups come back with decoupled_weight_decay, the key
    # AdamW brought when it became a subclass of Adam (pytorch#143710).
    old = FOLDER / "torch2.4.1"
    recorded = baselines.load(old / "gate.json")
    section = _judge(recorded, {"checkpoints": checkpoints.resume(old, ranks=False)})
    rows = {cells[0]: (ok, cells[-1]) for cells, ok in section["checkpoints"].rows}
    added = "+ optimizer.param_groups[0].decoupled_weight_decay: bool"
    mine = baselines.environment()
    same_kernels = all(recorded["recorded_with"].get(k) == mine[k]
                       for k in ("cpu", "cpu_capability"))
    failed = {}
    for key, (ok, verdict) in rows.items():
        if "decoupled_weight_decay" not in verdict:
            assert ok and verdict.startswith("schema as recorded"), (key, verdict)
            continue
        assert key.split("/")[0] in ("adam", "adam_amsgrad", "adamw"), (key, verdict)
        if same_kernels:
            # the same kernels: the continuation bit for bit, so a key gained is benign, and
            # the row passes saying so
            assert ok and verdict.startswith(f"schema saved after resuming gained {added} "
                                             f"(benign: "), (key, verdict)
            assert "continuation identical" in verdict
        else:
            assert verdict.startswith(f"schema saved after resuming CHANGED: {added}; "
                                      f"continuation "), (key, verdict)
        failed[key] = verdict
    if issubclass(torch.optim.AdamW, torch.optim.Adam):
        assert len(failed) == 3 * 4  # 3 families x all variants but the sharded (not run)
