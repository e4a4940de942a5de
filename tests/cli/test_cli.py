"""The command line: `hookbench report` prints every check, writes its PNG and JSON, and fails
when a check fails."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hookbench
from hookbench.cli import REPORT_PRINTS, main
from hookbench.core import names
from hookbench.measure.faults import inject
from hookbench.measure.parity import FAMILIES
from hookbench.report import MEMORY_STRATEGIES, SAVING_ROWS

# The small transformer keeps the memory section to about a second per strategy.
ARGS = ["report", "--model", "transformer", "--device", "fake"]


def by_row(data: dict) -> dict:
    return {m["strategy"]: m for m in data["memory"]}


# slow: the whole report, every section: the README's `hookbench report` (ViT-L/16), made once
# in the session for this test and the README's and docs/report.md's samples (conftest.py's
# readme_report, on whichever xdist worker asks first; issue 55). Until then this test ran a
# report of its own, the transformer's on --device fake (19.5 s on one thread), the slow tier's
# second. The default tier keeps each section's own tests and the report's exit code under a
# fault (below); examples/charlm/check.sh runs a report of a user's workload.
@pytest.mark.slow
def test_report_prints_writes_and_passes(readme_report):
    out, err = readme_report.stdout, readme_report.stderr
    backend = "cuda" if torch.cuda.is_available() else "fake"  # --device auto, the default
    assert f"torch {torch.__version__}" in out
    for family in FAMILIES:
        assert f"{family} " in out
    assert "bit-exact" in out and "FAILED" not in out
    assert f"Peak memory of one training step (vit_l_16, batch 1, Adam, backend {backend}" in out
    assert f"measuring vit_l_16 batch 1, in_backward, backend {backend}" in err  # progress
    assert "ZeRO-2 (sharded gradient release)" in out and "rank 0 of 64" in out
    assert (readme_report.out / "memory.png").read_bytes().startswith(b"\x89PNG")
    data = json.loads((readme_report.out / "report.json").read_text())
    assert [m["strategy"] for m in data["memory"]] == [*MEMORY_STRATEGIES,
                                                       *(row for row, *_ in SAVING_ROWS)]
    assert by_row(data)["in_backward + offload"]["host_peak"] > 0
    by = {m["strategy"]: m for m in data["memory"]}
    assert by["in_backward"]["peak"] < by["foreach"]["peak"]
    assert all(c["ok"] for c in data["checks"])


def test_report_exits_non_zero_when_a_check_fails(capsys, tmp_path):
    with inject("stops_after_first_backward"):
        assert main([*ARGS, "--sections", "contract,optimizer", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "VIOLATED" in out and "FAILED (marked !)" in out
    assert "Peak memory" not in out  # only the sections asked for
    assert main([*ARGS, "--sections", "contract,nope"]) == 2
    assert "unknown report sections ['nope']" in capsys.readouterr().err


def test_report_refuses_a_cuda_measurement_without_cuda(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    assert main([*ARGS[:3], "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "the cuda backend needs CUDA" in capsys.readouterr().err


def test_bad_arguments_are_refused(capsys):
    for argv in ([*ARGS, "--batch-size", "0"], ["report", "--model", "vgg"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-size must be >= 1" in err and "invalid choice: 'vgg'" in err


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "hookbench"  # installed beside this interpreter
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "report" in proc.stdout


def test_version_names_hookbench_and_torch():
    script = Path(sys.executable).parent / "hookbench"
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # torch's package version: 2.14.1 where torch.__version__ is 2.14.1+cu130
    assert re.fullmatch(rf"hookbench {re.escape(hookbench.__version__)} \(torch "
                        rf"{re.escape(torch.__version__.split('+')[0])}(\+\S+)?\)\n",
                        proc.stdout), proc.stdout


def test_report_help_gives_the_defaults_and_every_section_it_prints(capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", "--help"])
    assert e.value.code == 0
    said = " ".join(capsys.readouterr().out.split()).split(" options: ", 1)[1]  # unwrapped
    assert "the zoo model to measure (default: vit_l_16)" in said
    assert "(default: 1)" in said.split("--batch-size BATCH_SIZE", 1)[1].split("--out")[0]
    sections = said.split("--sections SECTIONS", 1)[1].split("--junit-xml")[0]
    assert list(REPORT_PRINTS) == list(names.REPORT_SECTIONS)
    printed = [name for prints in REPORT_PRINTS.values() for name in prints]
    assert "engines" in printed and all(name in sections for name in printed), sections


def test_report_zero2_prints_the_sections_its_help_names(capsys, monkeypatch, tmp_path):
    # the sections `--sections zero2` prints, by their keys (the JUnit file's suites), without
    # the ranks: each section's rows stubbed
    from hookbench import report
    from hookbench.gate import workload_checks
    from hookbench.gate.checks import Section

    def section(*args, **kwargs):
        done = Section("ZeRO-2 (stubbed)", ("check", "verdict"))
        done.add(True, "stub", "ok")
        return done

    monkeypatch.setattr(report, "zero2_section", section)
    monkeypatch.setattr(workload_checks, "zero2", lambda workloads, **kwargs: {
        f"{w.name}/engines/ddp": {"parity": "ok"} for w in workloads})
    monkeypatch.setattr(workload_checks, "engine_memory", lambda spec: {})
    junit = tmp_path / "report.xml"
    assert main([*ARGS, "--sections", "zero2", "--out", str(tmp_path),
                 "--junit-xml", str(junit)]) == 0
    suites = re.findall(r'<testsuite name="([^"]+)"', junit.read_text())
    assert tuple(suites) == REPORT_PRINTS["zero2"]
    assert "The engines users run" in capsys.readouterr().out


def test_capture_prints_a_per_layer_table(capsys):
    assert main(["capture", "--model", "resnet18", "--include", "layer1*", "--stats"]) == 0
    out = capsys.readouterr().out
    assert "resnet18, batch 1: 15 outputs from 13 modules (statistics)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("layer1.0.relu ")]
    assert [r[1] for r in rows] == ["0", "1"]  # the block's ReLU, called twice


def test_capture_names_close_matches_for_a_typo(capsys):
    assert main(["capture", "--include", "layr1"]) == 2
    assert "did you mean ['layer1'" in capsys.readouterr().err


@pytest.mark.parametrize("parametrization, code", [("mup", 0), ("sp", 1)])
def test_coord_check_verdict_and_plot(capsys, tmp_path, parametrization, code):
    argv = ["coord-check", "--parametrization", parametrization, "--widths", "32,512",
            "--seeds", "1", "--out", str(tmp_path)]
    assert main(argv) == code
    out = capsys.readouterr().out
    assert ("PASS" if code == 0 else "FAIL") in out and "both ways" in out
    assert "out       change" in out and "growth/shrinkage across widths" in out
    assert (tmp_path / f"coord-check-mlp-{parametrization}.png").exists()


@pytest.mark.peers
def test_coord_check_beside_microsoft_mup(capsys, tmp_path):
    pytest.importorskip("mup", reason="microsoft/mup is an optional peer: "
                                      "pip install -e '.[mup]'")
    argv = ["coord-check", "--peer", "mup", "--widths", "32,512", "--seeds", "1",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "out       coord. (mup)" in out
    assert "hookbench vs microsoft/mup: coordinates differ by at most 0 (relative)" in out


@pytest.mark.parametrize("argv, message", [
    (["--widths", "32,x"], "--widths must be comma-separated integers, got '32,x'"),
    (["--widths", "64,32"], "widths must be at least two increasing values"),
    (["--band", "0.5"], "band must be > 1"),
    (["--peer", "mup", "--parametrization", "sp"], "--peer mup compares muP"),
])
def test_coord_check_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    assert main(["coord-check", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hookbench coord-check: error: ") and message in err[-1]
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
@pytest.mark.distributed
def test_zero2_demo_prints_per_rank_memory_and_parity(capsys):
    assert main(["zero2", "--nproc", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-2, transformer, 2 ranks" in out
    peaks = [line for line in out.splitlines() if line.startswith("  rank ") and "peak" in line]
    assert len(peaks) == 2 and "gradient shard" in peaks[0]
    assert out.rstrip().endswith("parity: PASS")


@pytest.mark.slow
@pytest.mark.distributed
def test_report_zero2_rows_are_judged_against_their_bound(monkeypatch):
    from hookbench import report
    from hookbench.models.zoo import workload as zoo_workload

    spec = zoo_workload("transformer")
    section = report.zero2_section(spec, "fake", None, None)
    rows = {cells[0]: (ok, cells[-1]) for cells, ok in section.rows}
    # seen: fp32 0.85x, 0.71x, 0.68x the bound; bf16 with fp32 masters 0.98x, 0.76x, 0.69x
    labels = [f"transformer rank 0 of {n}{variant}" for n in report.ZERO2_RANKS
              for variant in ("", ", bf16", ", offload")]
    for label in labels:
        ok, verdict = rows[label]
        assert ok and "x the bound" in verdict, verdict
    for optimizer in ("SGD", "Adam"):
        ok, verdict = rows[f"{optimizer} bf16 + fp32 masters, 2 gloo ranks"]
        assert ok and verdict == "parameters bit-exact, masters bit-exact vs one process"
        ok, verdict = rows[f"{optimizer} fp16 + fp32 masters, 2 gloo ranks"]
        assert ok and re.fullmatch(r"parameters bit-exact, masters bit-exact, loss scale as "
                                   r"GradScaler's \([1-4] of 5 steps skipped\) vs one process",
                                   verdict), verdict
    measured = report.measure

    def second_bucket(*args, **kwargs):  # a rank that keeps one more bucket alive
        r = measured(*args, **kwargs)
        size = 2 if "param_dtype" in kwargs["optimizer_kwargs"] else 4  # gradient bytes
        r.peak += size * min(report.ZERO2_BUCKET, r.parameters // size)
        return r

    monkeypatch.setattr(report, "measure", second_bucket)
    section = report.zero2_section(spec, "fake", None, None)
    failed = [cells for cells, ok in section.rows if not ok]
    assert [cells[0] for cells in failed] == labels
    assert all("fails above 1.02x" in cells[-1] for cells in failed)


@pytest.mark.smoke
def test_capture_of_modules_that_never_run_is_one_line_and_exit_2(capsys):
    # nn.MultiheadAttention's fast path bypasses out_proj's forward (pytorch#78109).
    out_proj = "encoder.layers.encoder_layer_0.self_attention.out_proj"
    assert main(["capture", "--model", "vit_b_16", "--include", out_proj]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "produced no output in forward" in err[0]


def test_report_memory_rows_that_could_not_run_fail_or_skip_naming_why():
    from hookbench import report
    from hookbench.core.prerequisites import MissingPrerequisite, attempt
    from hookbench.gate.checks import Verdict

    def needs():
        raise MissingPrerequisite("fused CPU Adam needs torch >= 2.4; this is 2.3.1")

    def gone():
        raise ModuleNotFoundError("No module named 'torch.testing._internal.distributed'")

    section = report.memory_section([], {"fused": attempt(needs),
                                         "zero2": attempt(gone)})
    (fused, skipped), (zero2, failed) = section.rows
    assert skipped is Verdict.SKIPPED and fused[-1].startswith("SKIPPED: fused CPU Adam")
    assert not failed and zero2[-1] == ("FAILED: ModuleNotFoundError: No module named "
                                        "'torch.testing._internal.distributed'")
    assert not section.ok and section.skipped == 1
    assert len(fused) == len(zero2) == len(section.columns)


def test_a_torch_without_a_module_hookbench_loads_fails_in_one_line():
    # As if a release moved torch.utils._pytree (private): the command says so and exits 1.
    code = ("import sys, torch; sys.modules['torch.utils._pytree'] = None; "
            "from hookbench.__main__ import main; sys.exit(main(['gate']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hookbench: FAILED: cannot load hookbench on "
                                               f"torch {torch.__version__}: "), err
    assert "torch.utils._pytree" in err[0]


def test_speed_prints_the_whole_step_table_and_writes_it(capsys, tmp_path):
    # The MLP, 2 runs of 1 round (a few seconds): every pair of step_time.WHOLE_STEP_PAIRS, a ratio
    # per run; per parameter has no foreach form, so its foreach cell is "-".
    target = tmp_path / "speed.json"
    assert main(["speed", "--model", "mlp", "--runs", "2", "--rounds", "1",
                 "--json", str(target)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 runs of 1 interleaved rounds" in lines[0]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert list(rows) == ["for-loop", "foreach", "fused"]
    assert re.search(r"foreach\s+[\d.]+\s+-\s+\d", rows["foreach"]), rows["foreach"]
    table = json.loads(target.read_text())["table"]
    from hookbench.gate.step_time import WHOLE_STEP_PAIRS
    assert {impl: set(row) for impl, row in table.items()} == {
        impl: {"standard", *modes} for impl, modes in WHOLE_STEP_PAIRS.items()}
    assert all(len(v) == 2 and all(x > 0 for x in v) for row in table.values()
               for v in row.values())


def test_speed_targets_prints_each_ratio_beside_its_floor(capsys, tmp_path):
    target = tmp_path / "targets.json"
    assert main(["speed", "--targets", "--runs", "2", "--rounds", "1", "--json",
                 str(target)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 runs of 1 rounds" in lines[0]
    assert [line.split(" / ")[0].strip() for line in lines[2:]] == [
        "grouped in backward", "capture rms+mean_abs"]
    assert all(re.search(r"1\.(10|25)x (met|missed) +[\d.]+x \(", line) for line in lines[2:])
    table = json.loads(target.read_text())["targets"]
    assert set(table) == {"in_backward_grouped_vs_foreach", "grouped_floor_vs_foreach",
                          "capture_stats_vs_plain", "capture_floor_vs_plain"}
    assert all(len(v) == 2 and all(r > 0 for r in v) for v in table.values())


def test_the_grouped_floor_steps_as_the_foreach_step_does():
    # The floor is the real arithmetic, cut per module: after one step, bit for bit the
    # standard foreach step's parameters (foreach Adam is elementwise per tensor).
    from hookbench.gate import step_time
    from hookbench.measure.parity import FAMILIES, training

    cls, kw = FAMILIES["adam"]
    model, _ = step_time._per_module_foreach(step_time.BENCHMARK_MLP, (cls, kw))
    with training(step_time.BENCHMARK_MLP, cls, {**kw, "foreach": True}, "foreach") as t:
        t.step(1)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), t.model.parameters()))


@pytest.mark.parametrize("argv, message", [
    (["--runs", "0"], "--runs must be >= 1"),
    (["--json", "."], "--json .: is a folder, not a file"),
    (["--batch-size", "4"], "--batch-size is for zoo models"),
    (["--device", "cuda"], "--device cuda: CUDA is not available here"),
    (["--targets", "--workload", "transformer"], "--targets times the benchmarks' MLP"),
])
def test_speed_bad_input_is_one_line_and_exit_2(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU runner
    try:
        code = main(["speed", "--model", "mlp", *argv])
    except SystemExit as e:  # argparse's own refusals exit from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_missing_baseline_is_one_line_and_exit_2_saying_what_to_do(capsys, tmp_path,
                                                                     monkeypatch):
    missing = tmp_path / "nope.json"
    assert main(["gate", "--baseline", str(missing), "--sections", "hooks"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hookbench gate: error: no baseline at {missing}: check the path, or record "
                   f"one there deliberately with `hookbench record --baseline {missing}`"]
    monkeypatch.chdir(tmp_path)  # no baselines/ here: the default path is missing
    assert main(["gate", "--sections", "hooks"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run hookbench from the checkout's root" in err[0]


@pytest.mark.parametrize("argv", [["--help"], ["gate", "--help"], ["report", "--batch-size", "0"],
                                  ["gate", "--fault", "nope"], ["--version"]])
def test_help_and_bad_arguments_answer_before_torch_is_imported(argv):
    # `hookbench --help` took 5-6 s when the parser imported torch first (2 loaded cores); it
    # now parses from hookbench.core.names and imports the subcommands only to run one.
    code = ("import sys; from hookbench.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nsys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    answered = argv[-1] in ("--help", "--version")
    assert proc.returncode == (0 if answered else 2), proc.stderr[-2000:]
    assert ({"--help": "usage: hookbench", "--version": "hookbench "}[argv[-1]] in proc.stdout
            if answered else len(proc.stderr.strip().splitlines()) == 1)
