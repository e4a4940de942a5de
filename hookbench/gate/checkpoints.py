"""Checkpoints across PyTorch releases: training state saved by one torch, resumed by another.

An upgrade must read the checkpoints its predecessor wrote and continue training from them as
the predecessor would. PyTorch's history shows where that broke: ``step`` changing dtype and
the foreach dtype error (pytorch#110940, #111008, #115841), an integer ``step`` refused
(#127197), ``param_names`` entering the state_dict (#134107), AdamW becoming a subclass of Adam
with a new ``decoupled_weight_decay`` group key (#143710). PyTorch's own anchor is
``test_can_load_older_state_dict`` in test/test_optim.py.

``write(directory)`` trains ``SPEC`` (tied and frozen layers) for ``WRITTEN_AFTER`` steps with
every optimizer family of ``hookbench.measure.parity.FAMILIES`` under every variant, and saves model
and optimizer ``state_dict``s with ``torch.save``:

    standard        torch.optim.<family>(model.parameters(), foreach=False)
    in_backward     hookbench's OptimizerInBackward (its state_dict reads like the standard one)
    zero2_sharded   Zero2 on 2 gloo ranks: each rank's own Zero2.state_dict(), a file per rank
    zero2_gathered  Zero2.full_state_dict(), resumed by a standard optimizer in one process
    legacy_step     the standard file with every ``step`` a Python number, as torch < 1.12
                    wrote it (what ``test_can_load_older_state_dict`` loads; not a file)

``resume(directory)`` loads each file (``torch.load(weights_only=True)``), describes its schema
(``schema``: keys, the dtype and device of every state entry such as ``step``, param-group keys
and value types), loads it into a fresh model and optimizer, trains ``CONTINUED`` more steps on
the same data stream, and returns the continuation's fingerprint and the schema of the state
the optimizer then saves. ``hookbench record`` writes the files and stores what ``resume``
returned on the baseline torch; ``hookbench gate`` runs ``resume`` on the installed torch and
requires the same schemas and the same continuation (``hookbench.gate``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hookbench.core import launch
from hookbench.core.prerequisites import attempt, one_line
from hookbench.gate.baselines import fingerprint
from hookbench.gate.checks import Run, Section, trajectory_verdict
from hookbench.measure import bounds
from hookbench.measure.faults import inject
from hookbench.measure.parity import FAMILIES, Snapshot, tolerance
from hookbench.measure.zero2_runs import local_batch
from hookbench.mechanisms.optimizer_in_backward import OptimizerInBackward
from hookbench.mechanisms.zero2 import Zero2
from hookbench.models.zoo import TinySpec

__all__ = ["CONTINUED", "SPEC", "VARIANTS", "WRITTEN_AFTER", "resume", "schema", "write"]

# Rank processes take seconds: selfcheck runs the section clean and under its own faults.
FAULTS = ("step_dtype_changed", "checkpoint_key_renamed")

# Tied hidden layers (one parameter, two modules) and a frozen first layer (in the groups, no
# state): the two places where a state_dict's parameter numbering can go wrong. Batch 6 splits
# over 2 ranks; 50-element buckets make a backward reduce several.
SPEC = TinySpec(depth=3, width=8, batch_size=6, tied=True, frozen=True)
WRITTEN_AFTER, CONTINUED = 3, 2
VARIANTS = ("standard", "in_backward", "zero2_sharded", "zero2_gathered", "legacy_step")
WORLD, BUCKET = 2, 50
RANK_TIMEOUT = 120.0  # seconds for all of a run's ranks; they take ~5 on 2 shared cores


def _load(path: Path) -> dict[str, Any]:
    # weights_only=True: what a careful user loads with (and torch's default from 2.6); a
    # release whose unpickler stops accepting a plain optimizer state fails here.
    return torch.load(path, map_location="cpu", weights_only=True)


def _kind(value: Any) -> str:
    if torch.is_tensor(value):
        shape = "scalar" if value.dim() == 0 else "per-element"
        return f"tensor {str(value.dtype).removeprefix('torch.')} {value.device.type} {shape}"
    return type(value).__name__


def schema(checkpoint: dict[str, Any]) -> list[str]:
    """A checkpoint's structure as sorted lines, without its numbers: top-level keys, the model's
    entries (dtype, shape), which parameters have optimizer state, the kind of each state entry
    (``step: tensor float32 cpu scalar``) and each param group's keys and value types."""
    lines = {f"checkpoint keys: {sorted(checkpoint)}"}
    lines |= {f"model.{k}: {_kind(v)} {list(v.shape)}" for k, v in checkpoint["model"].items()}
    saved = checkpoint["optimizer"]
    lines.add(f"optimizer keys: {sorted(saved)}")
    optimizer = saved.get("optimizer", saved)  # Zero2's sharded state nests the optimizer's
    lines.add(f"optimizer.state of parameters {sorted(optimizer['state'])}")
    lines |= {f"optimizer.state.{key}: {_kind(value)}"
              for entry in optimizer["state"].values() for key, value in entry.items()}
    for i, group in enumerate(optimizer["param_groups"]):
        lines |= {f"optimizer.param_groups[{i}].{key}: {_kind(value)}"
                  for key, value in group.items()}
    return sorted(lines)


def difference(recorded: list[str], now: list[str]) -> list[str]:
    """What a schema gained (+) and lost (-) against the recorded one."""
    return ([f"- {line}" for line in recorded if line not in now]
            + [f"+ {line}" for line in now if line not in recorded])


# -- training ---------------------------------------------------------------------------------


def _optimizer(variant: str, model: torch.nn.Module, family: str):
    cls, kwargs = FAMILIES[family]
    if variant == "in_backward":
        return OptimizerInBackward(model, cls, **kwargs, foreach=False)
    # ZeRO-2's groups, and so its gathered state, hold the trainable parameters only
    params = [p for p in model.parameters() if p.requires_grad or variant == "standard"]
    return cls(params, **kwargs, foreach=False)


def _train(model: torch.nn.Module, optimizer: Any, steps: range, rank: int = 0,
           world: int = 1) -> list[Snapshot]:
    """Train on batches ``steps`` (this rank's share of each), after each step snapshotting
    the parameters and the state ``optimizer`` holds for them (none for ZeRO-2's pieces)."""
    snapshots = []
    for i in steps:
        x, y = local_batch(SPEC, i, rank, world, "cpu")
        SPEC.loss(model(x), y).backward()
        optimizer.step()  # OptimizerInBackward stepped in backward; its step() is a no-op
        optimizer.zero_grad()
        state = getattr(optimizer, "state", {})
        snapshot = {}
        for n, p in model.named_parameters():
            snapshot[n] = p.detach().clone()
            for key, value in state.get(p, {}).items():
                snapshot[f"{n}/{key}"] = torch.as_tensor(value).detach().clone()
        snapshots.append(snapshot)
    return snapshots


def _continue(saved: dict[str, Any], model: torch.nn.Module, optimizer: Any, rank: int = 0,
              world: int = 1) -> dict[str, Any]:
    """Load ``saved`` into ``optimizer`` (the model holds it already), train ``CONTINUED``
    steps: the schemas of the file and of the state saved again, and the continuation."""
    optimizer.load_state_dict(saved["optimizer"])
    continued = _train(model, optimizer, range(WRITTEN_AFTER, WRITTEN_AFTER + CONTINUED),
                       rank, world)
    resaved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return {"schema": schema(saved), "resaved": schema(resaved), **fingerprint(continued)}


def _path(directory: Path, family: str, variant: str, rank: int | None = None) -> Path:
    return Path(directory) / f"{family}-{variant}{'' if rank is None else f'-rank{rank}'}.pt"


def write(directory: str | Path, families: tuple[str, ...] = tuple(FAMILIES)) -> list[Path]:
    """Train and save every family under every variant into ``directory``; the written files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for family in families:
        for variant in ("standard", "in_backward"):
            model = SPEC.build()
            optimizer = _optimizer(variant, model, family)
            try:
                _train(model, optimizer, range(WRITTEN_AFTER))
                written.append(_path(directory, family, variant))
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           written[-1])
            finally:
                getattr(optimizer, "remove", lambda: None)()
    launch.run(_write_zero2, WORLD, str(directory), families, timeout=RANK_TIMEOUT)
    written += [_path(directory, f, "zero2_sharded", r) for f in families for r in range(WORLD)]
    return written + [_path(directory, f, "zero2_gathered") for f in families]


def _write_zero2(rank: int, world: int, directory: str, families: tuple[str, ...]) -> None:
    for family in families:
        cls, kwargs = FAMILIES[family]
        model = SPEC.build()
        with Zero2(model, cls, bucket_numel=BUCKET, **kwargs, foreach=False) as zero:
            _train(model, zero, range(WRITTEN_AFTER), rank, world)
            model_state = model.state_dict()
            torch.save({"model": model_state, "optimizer": zero.state_dict()},
                       _path(Path(directory), family, "zero2_sharded", rank))
            gathered = zero.full_state_dict()  # a collective: every rank calls it
            if rank == 0:
                torch.save({"model": model_state, "optimizer": gathered},
                           _path(Path(directory), family, "zero2_gathered"))


# -- resuming ---------------------------------------------------------------------------------


def _resume_one(directory: Path, family: str, variant: str) -> dict[str, Any]:
    written = "standard" if variant == "legacy_step" else variant
    saved = _load(_path(directory, family, written))
    if variant == "legacy_step":
        for entry in saved["optimizer"]["state"].values():
            if torch.is_tensor(entry.get("step")):
                entry["step"] = entry["step"].item()
    model = SPEC.build()
    model.load_state_dict(saved["model"])
    optimizer = _optimizer(written, model, family)
    try:
        return _continue(saved, model, optimizer)
    finally:
        getattr(optimizer, "remove", lambda: None)()


def resume(directory: str | Path, families: tuple[str, ...] = tuple(FAMILIES),
           fault: str | None = None, ranks: bool = True) -> dict[str, Any]:
    """For each ``family/variant``: the schema of the saved file, the schema of the state saved
    again after resuming, and the fingerprint of the continuation (or ``{"error": ...}``).
    ``fault``: a ``hookbench.measure.faults`` fault to inject in the ranks (the caller injects it in
    this process). ``ranks=False`` leaves out the ZeRO-2 sharded rows (no ranks started)."""
    directory = Path(directory)
    out = {f"{family}/{variant}": attempt(lambda: _resume_one(directory, family, variant))
           for family in families for variant in VARIANTS if variant != "zero2_sharded"}
    if ranks:
        try:
            sharded = launch.run(_resume_zero2, WORLD, str(directory), families, fault,
                                 timeout=RANK_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - every sharded row fails naming it
            sharded = [{f: {"error": one_line(e)} for f in families}] * WORLD
        for family in families:
            rows = [rank[family] for rank in sharded]
            errors = [f"rank {r}: {row['error']}" for r, row in enumerate(rows) if "error" in row]
            if not errors and any(row["sha256"] != rows[0]["sha256"] for row in rows):
                errors = ["the ranks continued to different parameters"]
            out[f"{family}/zero2_sharded"] = {"error": "; ".join(errors)} if errors else rows[0]
    return dict(sorted(out.items()))


def _resume_zero2(rank: int, world: int, directory: str, families: tuple[str, ...],
                  fault: str | None) -> dict[str, dict[str, Any]]:
    def one(family: str) -> dict[str, Any]:
        saved = _load(_path(Path(directory), family, "zero2_sharded", rank))
        cls, kwargs = FAMILIES[family]
        model = SPEC.build()
        model.load_state_dict(saved["model"])
        with Zero2(model, cls, bucket_numel=BUCKET, **kwargs, foreach=False) as zero:
            return _continue(saved, model, zero, rank, world)

    with inject(fault):
        return {family: attempt(lambda: one(family)) for family in families}


def measure(run: Run) -> dict[str, Any]:
    """``resume``: of the files ``hookbench record`` writes first (``run.recording``)."""
    if run.recording:
        write(run.checkpoint_dir)
    return resume(run.checkpoint_dir, fault=run.fault)


def judge(base: dict, now: dict, run: Run) -> Section:
    section = Section(f"Checkpoints written by the baseline torch, loaded and resumed for "
                      f"{CONTINUED} steps", ("family/variant", "verdict"))
    for key, value in now.items():
        if section.add_stopped(value, key):
            continue
        rec = base.get(key)
        if rec is None:
            section.add(False, key, "no baseline recorded; record with `hookbench record`")
            continue
        problems = [f"{what} CHANGED: {'; '.join(difference(rec[part], value[part]))}"
                    for part, what in (("schema", "file schema"),
                                       ("resaved", "schema saved after resuming"))
                    if rec[part] != value[part]]
        tol = bounds.DATA_PARALLEL if "zero2" in key else tolerance("foreach", SPEC.dtype)
        ok, continuation = trajectory_verdict(rec, value, tol, run.machine_note)
        # Benign: the recorded file loads as before and the continuation is identical, and what
        # is saved again only gains keys (torch 2.9.1's decoupled_weight_decay in a param group)
        gained = (rec["schema"] == value["schema"] and continuation.startswith("identical")
                  and set(rec["resaved"]) <= set(value["resaved"]))
        if problems and gained:
            problems = [f"schema saved after resuming gained "
                        f"{'; '.join(difference(rec['resaved'], value['resaved']))} "
                        f"(benign: the recorded file loads and the continuation is identical)"]
        section.add(ok and (not problems or gained), key, "; ".join(
            (problems or ["schema as recorded"]) + [f"continuation {continuation}"]))
    return section
