"""``hookbench engines`` and ``hookbench zero2 --workload`` on spawned ranks and under
torchrun: 4 ranks as 2 nodes of 2 on this machine (the multi-node recipe of docs/engines.md,
rendezvous on localhost), the rows holding, a fault failing them on every rank, and ranks that
run different things refusing on every rank, naming what differs. Every torchrun agent runs
under a timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import socket
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hookbench.cli import main
from hookbench.core import launch

pytestmark = pytest.mark.distributed

# A workload the 4 ranks share (4 samples, one each), importable by the ranks torchrun starts:
# the blocks model of test_engines.py (dropout, AdamW with weight decay), written into a module.
MODULE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn

    from hookbench import Workload


    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(6, 16)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1)) for _ in range(2))
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)


    def batch(g):
        return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


    WORKLOAD = Workload("blocks", model=Blocks, batch=batch, loss=F.cross_entropy,
                        optimizer=(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}))
''')
AGENT_TIMEOUT = 300  # seconds: one agent and its two ranks, started together with the other


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for torchrun's rendezvous
    (the first agent binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("torchrun")
    (folder / "blocks_workload.py").write_text(MODULE)
    return folder


def torchrun(project: Path, *extra: list[str], command: str = "engines"
             ) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents (``--nnodes 2 --nproc-per-node 2``), rendezvous on localhost; the
    i-th agent's ``hookbench <command>`` gets ``extra[i]`` after the workload."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(project), *filter(None, [os.environ.get("PYTHONPATH")])])}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
         "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
         "--rdzv-id", "hookbench-test", "-m", "hookbench", command, "--timeout", "120",
         "--workload", "blocks_workload:WORKLOAD", *args],
        cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for args in extra]
    done = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=AGENT_TIMEOUT)
            done.append(subprocess.CompletedProcess(agent.args, agent.returncode, out))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return done


@pytest.mark.slow
def test_four_ranks_as_two_nodes_hold_every_engine_row(project):
    agents = torchrun(project, [], [])
    printed = "".join(a.stdout for a in agents)
    assert [a.returncode for a in agents] == [0, 0], printed
    assert "The engines on 4 gloo ranks" in printed
    assert re.search(r"^\d of 5 checks hold(; 1 SKIPPED|$)", printed, re.M), printed  # DeepSpeed
    assert not re.search(r"^! ", printed, re.M), printed
    # 4 ranks sum their gradients in another order than DDP's all-reduce: not bit for bit
    assert "4 ranks' gradients are summed in another order than DDP's" in printed
    assert "vs FSDP2 ZeRO-3 with a standard step: bit-exact" in printed


@pytest.mark.slow
def test_a_fault_fails_the_rows_on_four_ranks_and_every_rank_exits_1(project):
    agents = torchrun(project, ["--fault", "reduce_scatter_wrong_slice"],
                      ["--fault", "reduce_scatter_wrong_slice"])
    printed = "".join(a.stdout for a in agents)
    assert [a.returncode for a in agents] == [1, 1], printed
    assert re.search(r"^! blocks/engines/fsdp2_zero2 ", printed, re.M), printed


@pytest.mark.slow
def test_ranks_that_run_different_things_refuse_on_every_rank_naming_it(project):
    agents = torchrun(project, [], ["--fault", "fires_twice"])
    printed = "".join(a.stdout for a in agents)
    assert [a.returncode for a in agents] == [1, 1], printed  # torchrun: a rank exited 2
    # Counted, not matched per line: the 4 ranks share 2 agents' output, written concurrently.
    said = printed.split("hookbench engines: error: the ranks do not run the same thing: ")[1:]
    assert len(said) == 4, printed  # every rank, each naming the fault that differs
    assert all(re.match(r"rank \d has fault 'fires_twice', rank 0 None", s) for s in said), said


@pytest.mark.slow
def test_spawned_ranks_print_the_rows(capsys, project, monkeypatch):
    monkeypatch.syspath_prepend(str(project))
    assert main(["engines", "--workload", "blocks_workload:WORKLOAD", "--nproc", "4"]) == 0
    out = capsys.readouterr().out
    assert "The engines on 4 gloo ranks" in out and not re.search(r"^! ", out, re.M), out


def test_spawned_ranks_beside_cuda_run_and_say_gloo(capsys, monkeypatch):
    # On a GPU host the spawned ranks still run gloo on the CPU (torchrun's run nccl): the
    # header said "nccl" there; it now names the backend the ranks are given. CUDA is made to
    # look present in this process, the ranks are not started: which backend they are given.
    given = []

    def run(fn, world, *args, timeout, backend):
        given.append(backend)
        raise RuntimeError("not started")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch, "run", run)
    assert main(["engines", "--nproc", "2"]) == 2 and given == ["gloo"]


def test_torchrun_ranks_with_nccl_each_take_their_local_gpu(monkeypatch):
    # torch.cuda and the process group faked: which device each local rank binds before the
    # group exists (all on cuda:0, NCCL answers "Duplicate GPU detected")
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)

    def init(backend, timeout=None, device_id=None):  # init_process_group's, torch >= 2.3
        bound.append((backend, device_id))
        raise KeyError("stop here")

    monkeypatch.setattr(launch.dist, "init_process_group", init)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(KeyError, match="stop here"):
        launch.on_torchrun(lambda rank, world: None, (), {}, 10.0, lambda got, errors: 0)
    assert bound == [torch.device("cuda", 3), ("nccl", torch.device("cuda", 3))]


def test_a_batch_the_ranks_cannot_share_is_one_line_and_exit_2(capsys):
    # the gate's tiny MLP has 6 samples: they do not split over 4 ranks
    assert main(["engines", "--nproc", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hookbench engines: error:" in err[0], err
    assert "4" in err[0]


@pytest.mark.slow
def test_zero2_on_a_workload_under_torchrun_holds_against_ddp_on_4_ranks(project):
    agents = torchrun(project, [], [], command="zero2")
    printed = "".join(a.stdout for a in agents)
    assert [a.returncode for a in agents] == [0, 0], printed
    assert "ZeRO-2, blocks, 4 ranks, global batch 4, 3 steps of AdamW" in printed
    assert len(re.findall(r"^  rank \d: peak .* gradient shard", printed, re.M)) == 4, printed
    assert re.search(r"^  blocks/zero2 +vs DDP on the same shares: ", printed, re.M), printed
    assert "1 of 1 checks hold" in printed


@pytest.mark.slow
def test_zero2_on_a_workload_fails_its_row_under_a_fault(capsys, project, monkeypatch):
    monkeypatch.syspath_prepend(str(project))
    argv = ["zero2", "--workload", "blocks_workload:WORKLOAD", "--nproc", "2"]
    assert main(argv) == 0
    held = capsys.readouterr().out
    assert re.search(r"^  blocks/zero2 +vs DDP on the same shares: bit-exact", held, re.M), held
    assert main([*argv, "--fault", "collective_wrong_slice"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^! blocks/zero2 ", out, re.M) and "0 of 1 checks hold" in out, out


@pytest.mark.parametrize("argv, message", [
    (["--workload", "blocks_workload:WORKLOAD", "--nproc", "3"],
     "does not split over 3 data-parallel ranks"),
    (["--fault", "fires_twice"], "--fault needs --workload"),
    (["--workload", "blocks_workload:NOPE"], "NOPE"),
])
def test_zero2_bad_input_is_one_line_and_exit_2_before_any_rank_starts(
        capsys, project, monkeypatch, argv, message):
    monkeypatch.syspath_prepend(str(project))
    assert main(["zero2", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hookbench zero2: error: "), err
    assert message in err[0] and "spawning" not in captured.err
