"""Running a function on N gloo ranks in spawned processes, safely: a free port, a timeout,
and a failing rank that fails the run instead of hanging it.

``run(fn, world_size, *args)`` starts ``world_size`` processes, initializes a gloo (or nccl)
process group on a free localhost port in each, calls ``fn(rank, world_size, *args)``, and returns the
per-rank results. If a rank raises, the others are terminated and ``RankFailed`` names it with
its traceback; if the whole run outlives ``timeout`` seconds, every process is killed and
``TimeoutError`` is raised. ``fn`` and its arguments must be picklable (module-level).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailed", "free_port", "run"]


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout: float, out: str, backend: str,
            fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)  # N ranks share this machine's cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    try:
        torch.save(fn(rank, world, *args), Path(out) / f"rank{rank}.pt")
    except BaseException:
        # When it failed, written before the teardown below makes the peers fail too.
        (Path(out) / f"rank{rank}.failed").write_text(str(time.time_ns()))
        raise
    finally:
        dist.destroy_process_group()


def _failures(context: Any, world_size: int, out: str) -> str:
    """Every rank's traceback, the first to fail first: when one rank dies, the others fail
    too (a collective loses its peer), and the root cause is the earliest."""
    failed = []
    for rank, path in enumerate(context.error_files):
        if os.path.exists(path) and os.path.getsize(path):
            marker = Path(out) / f"rank{rank}.failed"
            when = int(marker.read_text()) if marker.exists() else time.time_ns()
            with open(path, "rb") as f:
                failed.append((when, rank, _traceback(f.read())))
    failed.sort()
    return "\n".join(f"rank {rank} of {world_size} failed{' first' if i == 0 else ''}:\n{tb}"
                     for i, (_, rank, tb) in enumerate(failed))


def _traceback(raw: bytes) -> str:
    try:
        return str(pickle.loads(raw))
    except Exception:  # noqa: BLE001 - an unreadable record still names the rank
        return raw.decode(errors="replace")


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
        backend: str = "gloo") -> list:
    """``[fn(rank, world_size, *args) for rank in ...]``, each rank in its own process
    (``backend="nccl"``: one GPU per rank)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _worker, args=(world_size, free_port(), timeout, out, backend, fn, args),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks did not finish in {timeout:g} s")
        except mp.ProcessRaisedException:
            raise RankFailed(_failures(context, world_size, out)) from None
        except mp.ProcessExitedException as e:
            raise RankFailed(f"rank {e.error_index} of {world_size} exited with code "
                             f"{e.exit_code}") from None
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
