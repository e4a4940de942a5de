"""Running a function on N gloo ranks in spawned processes, safely: a rendezvous no other
process can take, a timeout, and a failing rank that fails the run instead of hanging it.

``run(fn, world_size, *args)`` starts ``world_size`` processes, initializes a gloo (or nccl)
process group in each through a store the caller hosts on localhost (on a port the kernel picks
as it binds, so none can take it first: a port chosen free and bound by rank 0 seconds later
was, under load, taken in between by another group's gloo connections, EADDRINUSE), calls
``fn(rank, world_size, *args)``, and
returns the per-rank results. If a rank raises, the others are terminated and ``RankFailed``
names it with its traceback; if the whole run outlives ``timeout`` seconds, every process is
killed and ``TimeoutError`` is raised. A rank dies with the process that started it, also one
killed with SIGKILL, and leaves Ctrl-C and SIGTERM to it (``hookbench.core.orphans``). ``fn``
and its arguments must be picklable (module-level).

``beside(fn, world_size, *args)`` makes the calling process rank 0 and spawns the other ranks
to run ``fn``: what the ranks do together can then be timed from the driving process (the
ZeRO-2 benchmark), with the same failure and timeout handling on exit.

``on_torchrun(fn, args, what, timeout, verdict)`` is the same call on the ranks torchrun
started (``torchrun_world()`` says whether it did): every rank first shows the others ``what``
it runs and raises, naming it, where any differs; a rank whose ``fn`` raises sends its error
instead of its result, so that none waits for it; rank 0 turns the results into an exit code,
with which every rank returns.

``rank_threads()`` gives the calling process a rank's intra-op threads (``RANK_THREADS``): a
reference computed in one process for the ranks to be held to runs the kernels the ranks run
(oneDNN's convolutions sum in another order with another thread count).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import io
import json
import logging
import multiprocessing.resource_tracker
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hookbench.core import orphans
from hookbench.core.prerequisites import StorageFailed, write_bytes

__all__ = ["RANK_THREADS", "RankFailed", "beside", "on_torchrun", "rank_threads", "run",
           "torchrun_backend", "torchrun_world"]

RANK_THREADS = 1  # N ranks share this machine's cores


@contextlib.contextmanager
def rank_threads() -> Iterator[None]:
    """This process with a spawned rank's intra-op threads, restored on exit."""
    before = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback, ``summary`` the one line a verdict
    row shows: which rank failed first, and its exception. Where the rank's process died
    instead (a signal, an exit), ``rank`` and ``exit_code`` say which and how."""

    def __init__(self, message: str, rank: int | None = None,
                 exit_code: int | None = None) -> None:
        super().__init__(message)
        self.rank, self.exit_code = rank, exit_code

    @property
    def summary(self) -> str:
        lines = [line for line in str(self).splitlines() if line.strip()]
        if len(lines) < 2:
            return lines[0] if lines else ""
        # the first rank's block: its header line, then its traceback up to the next header
        end = next((i for i, line in enumerate(lines[1:], 1) if " failed" in line
                    and line.startswith("rank ")), len(lines))
        return f"{lines[0]} {lines[end - 1].strip()}"


def _host(timeout: float) -> dist.TCPStore:
    """The ranks' rendezvous, hosted by the caller: a store listening on 127.0.0.1, on a port
    the kernel picks as it binds (``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def _init(backend: str, port: int, rank: int, world: int, timeout: float,
          store: dist.Store | None = None) -> None:
    """Join the group through the caller's store (``_host``), or ``store`` where this process
    hosts it."""
    limit = datetime.timedelta(seconds=timeout)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, None, False, limit)
    with quiet_stdout():
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=limit)


@contextlib.contextmanager
def quiet_stdout():
    """File descriptor 1 to /dev/null while the block runs: what C++ prints there, past
    Python's streams and torch's log levels (gloo on torch 2.9.1 prints "[Gloo] Rank 1 is
    connected to 1 peer ranks. ..." as each group connects). Errors still raise."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _done() -> None:
    # Free what fn left behind while the interpreter is fully alive: FSDP2 keeps the gloo work
    # of its last reduce-scatter in reference cycles, and a gloo work freed only at interpreter
    # finalization aborts the process ("terminate called without an active exception", exit
    # code -6; seen twice in full-suite runs, see pytorch/pytorch#179291). Then every rank is
    # done with the group before any tears it down (rank 0 also hosts the store).
    gc.collect()
    dist.barrier()


def _worker(index: int, first: int, world: int, port: int, timeout: float, out: str,
            backend: str, fn: Callable[..., Any], args: tuple) -> None:
    # tied to its parent already, at its first import of hookbench (orphans.run)
    rank = first + index  # run: ranks 0..N-1; beside: 1..N-1, the caller being 0
    torch.set_num_threads(RANK_THREADS)
    try:
        _init(backend, port, rank, world, timeout)
        _save(fn(rank, world, *args), Path(out) / f"rank{rank}.pt")
        _done()
    except StorageFailed as e:  # the file system failed this rank: the caller's to say
        (Path(out) / f"rank{rank}.oserror").write_text(
            json.dumps([e.errno, e.strerror, e.filename]))
        sys.exit(1)
    except Exception:
        # For RankFailed, and written before the teardown below makes the peers fail too: the
        # time says which rank failed first. The traceback is pickled, as ProcessContext.join
        # reads it; it is the caller's to print.
        (Path(out) / f"rank{rank}.failed").write_text(str(time.time_ns()))
        with open(_error_file(out, rank), "wb") as f:
            pickle.dump(traceback.format_exc(), f)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _save(result: Any, path: Path) -> None:
    """``torch.save`` of a rank's result, a failing file system as ``StorageFailed``."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    write_bytes(path, buffer.getbuffer())


def _error_file(out: str, rank: int) -> str:
    return str(Path(out) / f"rank{rank}.error")


def _failures(context: Any, first: int, world_size: int, out: str) -> str:
    """Every rank's traceback, the first to fail first: when one rank dies, the others fail
    too (a collective loses its peer), and the root cause is the earliest."""
    failed = []
    for rank, path in enumerate(context.error_files, start=first):
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


def _spawn(first: int, world_size: int, timeout: float, out: str, backend: str,
           fn: Callable[..., Any], args: tuple, port: int) -> Any:
    # The ranks' C++ warnings (DDP's find_unused_parameters advice, printed from the autograd
    # thread on every run) are left out unless the caller asks for them: errors still print.
    level = os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # The ranks start with Ctrl-C and SIGTERM blocked (a mask survives exec) and keep them so
    # until they are tied to this process, which then ignores both (orphans.tie_to): one sent
    # to the process group while a rank still imports would otherwise print its
    # KeyboardInterrupt traceback (or "Fatal Python error: init_import_site"). multiprocessing
    # unblocks both when it starts its resource tracker, so that is started first. This
    # process's own handlers stay as they are: a signal to the process goes to any thread that
    # does not block it (torch's pool threads), and one ignored here would be lost for good.
    # And each rank is told its parent, to tie itself to it before it imports torch: its entry
    # point is orphans.run, not torch's (see there).
    multiprocessing.resource_tracker.ensure_running()
    outer, os.environ[orphans.ENV] = os.environ.get(orphans.ENV), str(os.getpid())
    masking = hasattr(signal, "pthread_sigmask")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, orphans.LEFT_TO_PARENT) if masking else None
    spawn, processes = multiprocessing.get_context("spawn"), []
    try:
        try:
            for index in range(world_size - first):
                work = (_worker, (index, first, world_size, port, timeout, out, backend, fn,
                                  args))
                processes.append(spawn.Process(target=orphans.run, args=(pickle.dumps(work),)))
                processes[-1].start()
        finally:
            if outer is None:
                del os.environ[orphans.ENV]
            else:
                os.environ[orphans.ENV] = outer
            if level == "ERROR" and os.environ.get("TORCH_CPP_LOG_LEVEL") == "ERROR":
                del os.environ["TORCH_CPP_LOG_LEVEL"]
            if masking:  # a signal pending since the spawn is handled here, as Interrupted
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return mp.ProcessContext(processes, [_error_file(out, first + index)
                                             for index in range(len(processes))])
    except BaseException:  # Ctrl-C or SIGTERM among them: no rank is left behind
        _stop(processes)
        raise


def _join(context: Any, first: int, world_size: int, timeout: float, out: str) -> None:
    """Wait for the spawned ranks; a failed one raises RankFailed, a late one TimeoutError.
    Whatever happens, no process outlives this call."""
    deadline = time.monotonic() + timeout
    # torch logs "Terminating process ... via signal SIGTERM" for each peer of a failed rank:
    # RankFailed says which failed first, so that line stays off the terminal
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks did not finish in {timeout:g} s")
    except mp.ProcessRaisedException:
        raise RankFailed(_failures(context, first, world_size, out)) from None
    except mp.ProcessExitedException as e:
        failed = sorted(Path(out).glob("rank*.oserror"))
        if failed:  # not a failure of the ranks' work: the caller stops, saying so
            raise StorageFailed(*json.loads(failed[0].read_text())) from None
        rank = first + e.error_index
        raise RankFailed(f"rank {rank} of {world_size} {died(e.exit_code)}", rank,
                         e.exit_code) from None
    finally:
        spawn_log.setLevel(level)
        _stop(context.processes)


def died(exit_code: int) -> str:
    """How a process ended, in words: ``exited with code 1``, ``was killed by SIGSEGV``."""
    if exit_code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-exit_code).name}"
    return f"exited with code {exit_code}"


def _stop(processes: list) -> None:
    """Kill and reap each started process still running."""
    for p in processes:
        if p.pid is None:  # interrupted while it was being started: no process of ours
            continue
        if p.is_alive():
            p.kill()
        p.join()


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
        backend: str = "gloo") -> list:
    """``[fn(rank, world_size, *args) for rank in ...]``, each rank in its own process
    (``backend="nccl"``: one GPU per rank)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    host = _host(timeout)  # lives until every rank is joined
    with tempfile.TemporaryDirectory() as out:
        context = _spawn(0, world_size, timeout, out, backend, fn, args, host.port)
        _join(context, 0, world_size, timeout, out)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]


@contextlib.contextmanager
def beside(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
           backend: str = "gloo") -> Iterator[None]:
    """Within the block this process is rank 0 of a gloo (or nccl) group of ``world_size``
    ranks; the others run ``fn(rank, world_size, *args)`` in spawned processes. On exit the
    group is destroyed and the ranks joined (``RankFailed``, ``TimeoutError`` as for ``run``)."""
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 (rank 0 is this process), got {world_size}")
    if dist.is_initialized():
        raise ValueError("this process is already in a process group")
    host = _host(timeout)
    with tempfile.TemporaryDirectory() as out:
        context, interrupted = None, False
        try:
            context = _spawn(1, world_size, timeout, out, backend, fn, args, host.port)
            _init(backend, host.port, 0, world_size, timeout, host)
            try:
                yield
                _done()
            finally:
                dist.destroy_process_group()
        except (KeyboardInterrupt, SystemExit):
            # Ctrl-C or SIGTERM (hookbench.cli.interrupts): nothing to wait for. A rank waiting
            # on this one in a collective, or not yet in the group, would end only at its timeout,
            # and a rank's failure would replace the interrupt.
            interrupted = True
            raise
        finally:
            if interrupted and context is not None:
                _stop(context.processes)
            elif context is not None:  # None: _spawn raised, and stopped what it had started
                _join(context, 1, world_size, timeout, out)


def torchrun_backend() -> str:
    """The backend ``on_torchrun`` runs: nccl where CUDA is, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def torchrun_world() -> int | None:
    """The world size where torchrun started this process as one of its ranks, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _same_everywhere(mine: dict[str, Any], world: int) -> None:
    """Every rank's ``mine``, gathered; raises on every rank where one differs."""
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    differ = [f"rank {r} has {key} {theirs[key]!r}, rank 0 {everyone[0][key]!r}"
              for r, theirs in enumerate(everyone) for key in mine
              if theirs[key] != everyone[0][key]]
    if differ:
        raise ValueError(f"the ranks do not run the same thing: {'; '.join(differ)}")


def on_torchrun(fn: Callable[..., Any], args: tuple, what: dict[str, Any], timeout: float,
                verdict: Callable[[list, list[str]], int]) -> int:
    """``fn(rank, world, *args)`` on this torchrun rank (``torchrun_backend``, each local rank
    on GPU ``LOCAL_RANK`` with nccl, each collective failing after ``timeout`` seconds); rank 0
    calls ``verdict(results, errors)`` (``errors``: "rank r: Type: message" of each rank whose
    ``fn`` raised, whose result is then None) and every rank returns the code it returned."""
    backend = torchrun_backend()
    options: dict[str, Any] = {}
    if backend == "nccl":
        # Each local rank on its own GPU before the group exists: without it every rank of a
        # node runs on cuda:0, and NCCL's first collective answers "Duplicate GPU detected".
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            options["device_id"] = device  # torch >= 2.3: the group binds to it at once
    with quiet_stdout():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **options)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        _same_everywhere(what, world)
        try:
            mine: Any = ("result", fn(rank, world, *args))
        except Exception as e:  # noqa: BLE001 - sent to rank 0, which says it; nobody waits
            mine = ("error", f"rank {rank}: {type(e).__name__}: {e}")
        got: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(mine, got, dst=0)
        code = [1]  # rank 0's, where its verdict itself raises; the others receive rank 0's
        try:
            if got is not None:
                code = [verdict([value if kind == "result" else None for kind, value in got],
                                [value for kind, value in got if kind == "error"])]
        finally:
            dist.broadcast_object_list(code, src=0)  # every rank exits with rank 0's verdict
        return code[0]
    finally:
        # FSDP2's last gloo work, freed by the collector now and not at interpreter exit,
        # where it aborted a rank ("terminate called without an active exception"; _done).
        gc.collect()
        dist.destroy_process_group()
