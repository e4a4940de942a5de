"""Stored baselines: what the verified torch did, recorded on purpose and read back to compare.

``baselines/gate.json`` is what ``hookbench gate`` compares the installed torch with, and
``hookbench record`` is the only thing that writes it (nothing records automatically):

    recorded_with  the baseline's schema (``SCHEMA``), the hookbench that wrote it, torch and
                   its intra-op threads, CPU capability (AVX2, AVX512, ...), Python, machine
    hooks          each hook-contract check's outcome (null: it holds)
    numerics       per short deterministic trajectory: a SHA-256 of every step's parameters and
                   optimizer state, bit for bit, and the final parameters as numbers
    collectives    per world size, collective and ReduceOp: "ok", "unsupported: ..." or
                   "WRONG: ..." against a hand computation (``hookbench.gate.collectives``)
    checkpoints    per optimizer family and variant: the schema of the checkpoint file (kept
                   in checkpoints/ beside this file), the schema of the state saved again after
                   resuming, and the continuation's checksum (``hookbench.gate.checkpoints``)
    compile        per backend and check: None where a compiled model's hooks behave as in
                   eager, else the difference (``hookbench.gate.compiled_hooks``)
    warnings       per mechanism's run: the warnings it emitted (``hookbench.gate.emitted_warnings``)
    memory         per model/strategy: the fake backend's peak, its breakdown by category and
                   the most gradient bytes alive at once
    time           ratios of step times measured on the recording machine

A checksum can only match where the arithmetic is the same: the same torch kernels on the same
CPU capability. Elsewhere (or after an upgrade that legitimately reorders a sum) the final
parameters are compared with the suite's stated tolerance instead, and the change is reported.

pytest-benchmark's own runs live beside this file in ``baselines/benchmarks``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from hookbench.core import names
from hookbench.measure.parity import Snapshot

__all__ = ["DEFAULT", "SCHEMA", "checkpoint_folder", "environment", "fingerprint",
           "final_parameters", "load", "migrate", "same_kernels", "serialised", "stage_beside",
           "write_atomically"]

DEFAULT = Path(names.BASELINE)  # relative to the checkout, where hookbench is run
# The baseline's format. 1: every baseline before it was numbered (no "schema" in
# recorded_with); 2: recorded_with also says which hookbench wrote it, its schema and torch's
# intra-op threads (fp32 sums split over threads round differently: examples/hf's ViT is 72x
# its tolerance away on one thread from what it trained to on two). A change to what a row
# stores is a new number here and a step in ``migrate``.
SCHEMA = 2


def checkpoint_folder(baseline: str | Path = DEFAULT) -> Path:
    """Where the checkpoint files of a baseline are: checkpoints/ beside its json."""
    return Path(baseline).parent / "checkpoints"


def replay_file(baseline: str | Path = DEFAULT) -> Path:
    """Where a baseline's workloads' random draws (``hookbench.core.draws``) and step traces
    (``hookbench.measure.trace``) are: ``<name>.replay.pt`` beside its json."""
    return Path(baseline).with_suffix(".replay.pt")


def environment() -> dict[str, str]:
    """What a checksum depends on, and what a reader of the baseline wants to know. The CPU's
    model, not only its capability: two AVX512 Xeons were seen to round the same fp32 training
    differently (up to 3e-8 after one step), the BLAS choosing its kernels by model."""
    return {"schema": SCHEMA, "hookbench": names.installed_version("hookbench") or "not installed",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": _cpu_model(), "python": platform.python_version(),
            "machine": platform.machine()}


def same_kernels(recorded: dict[str, Any], here: dict[str, Any]) -> bool:
    """Whether a checksum recorded with ``recorded`` (``environment()``) can match one made
    ``here``: the same torch, CPU, Python and machine, and the same threads where both are
    known (a schema-1 baseline did not record them). Which hookbench wrote it does not change
    the arithmetic."""
    return all(recorded.get(k) == here.get(k) for k in here
               if k not in ("schema", "hookbench")
               and not (k == "threads" and None in (recorded.get(k), here.get(k))))


def migrate(data: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """``data`` as this hookbench's schema reads it: an older schema brought up step by step,
    what it did not record said to be unknown (None); a newer one, or one no step reads,
    refused in one line naming the file, never compared as if it were this one's."""
    recorded = data["recorded_with"]
    schema = recorded.get("schema", 1)
    if schema == 1:  # rows as schema 2 stores them; only recorded_with lacked the facts
        data = {**data, "recorded_with": {**recorded, "schema": 2, "hookbench": None,
                                          "threads": None}}
    elif schema != SCHEMA:
        raise ValueError(f"{path}: a baseline of hookbench's schema {schema!r} (written by "
                         f"hookbench {recorded.get('hookbench')}); this hookbench reads schema "
                         f"{SCHEMA} and older: record it again with `hookbench record`, or "
                         f"gate with the hookbench that wrote it")
    return data


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or "unknown"


def fingerprint(snapshots: list[Snapshot], sample: int | None = None) -> dict[str, Any]:
    """A trajectory as stored: the SHA-256 of every entry of every step (names, dtypes, shapes
    and bytes) and the last step's parameters as numbers (exact: float32 round-trips through
    JSON's float64). ``sample``: only that many evenly spaced elements of each parameter, and
    its float64 L2 norm (``name#norm``), for models whose every value would make the baseline
    as large as the model (a user's workload)."""
    digest = hashlib.sha256()
    for snapshot in snapshots:
        for key in sorted(snapshot):
            t = snapshot[key].detach().cpu().contiguous()
            digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
            digest.update(bytes(t.flatten().view(torch.uint8).tolist()))
    last = {k: v for k, v in snapshots[-1].items() if "/" not in k}
    if sample is not None:
        last = _sampled(last, sample)
    # a complex tensor as its (real, imaginary) pairs: JSON has no complex numbers
    final = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                 "values": (torch.view_as_real(v) if v.is_complex() else v).flatten().tolist()}
             for k, v in last.items()}
    return {"sha256": digest.hexdigest(), "final": final}


def _sampled(parameters: Snapshot, n: int) -> Snapshot:
    out = {}
    for key, value in parameters.items():
        flat = value.detach().cpu().flatten()
        where = torch.linspace(0, max(flat.numel() - 1, 0), min(n, flat.numel())).round().long()
        out[key] = flat[where]
        out[f"{key}#norm"] = torch.linalg.vector_norm(
            flat.to(torch.complex128 if flat.is_complex() else torch.float64)).reshape(1)
    return out


def final_parameters(stored: dict[str, Any]) -> Snapshot:
    """The stored last step's parameters as tensors, to compare with a tolerance."""
    return {k: _tensor(v["values"], getattr(torch, v["dtype"]), v["shape"])
            for k, v in stored["final"].items()}


def _tensor(values: list[float], dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if dtype.is_complex:  # stored as (real, imaginary) pairs
        pairs = torch.tensor(values, dtype=dtype.to_real()).reshape(*shape, 2)
        return torch.view_as_complex(pairs)
    return torch.tensor(values, dtype=dtype).reshape(shape)


def load(path: str | Path = DEFAULT) -> dict[str, Any]:
    """The stored baseline; a missing, unreadable or foreign file raises naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no baseline at {path}: run hookbench from the checkout's root (where baselines/ "
            f"is), pass --baseline, or record one deliberately with `hookbench record`"
            if path == DEFAULT else
            f"no baseline at {path}: check the path, or record one there deliberately with "
            f"`hookbench record --baseline {path}`")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable baseline ({e}); record one with "
                         f"`hookbench record`") from None
    recorded = data.get("recorded_with") if isinstance(data, dict) else None
    if not isinstance(recorded, dict) or not {"torch", "cpu_capability"} <= set(recorded):
        raise ValueError(f"{path}: not a hookbench baseline (no recorded_with.torch and "
                         f".cpu_capability); record one with `hookbench record`")
    wrong = sorted(k for k, v in data.items() if k != "recorded_with" and not isinstance(v, dict))
    if wrong:
        raise ValueError(f"{path}: sections {wrong} are not tables; the file is damaged or "
                         f"from another tool")
    return migrate(data, path)


def serialised(data: dict[str, Any]) -> str:
    """A baseline as its file holds it."""
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def stage_beside(path: Path, content: str | bytes) -> Path:
    """``content`` in a new file beside ``path`` (the same file system, so that renaming it
    over ``path`` takes no room), with the mode ``path`` has, else a new file's usual 0644 (not
    mkstemp's 0600, which would keep a baseline from the rest of the team). A full disk fails
    here, leaving nothing behind."""
    handle, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb" if isinstance(content, bytes) else "w",
                       **({} if isinstance(content, bytes) else {"encoding": "utf-8"})) as f:
            f.write(content)
        os.chmod(staged, path.stat().st_mode & 0o777 if path.exists() else 0o644)
    except BaseException:
        os.unlink(staged)
        raise
    return Path(staged)


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all: staged beside it and renamed over it, so
    that a run stopped part-way (an interrupt, a full disk) leaves the file as it was."""
    staged = stage_beside(path, text)
    try:
        os.replace(staged, path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
