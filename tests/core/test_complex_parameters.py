"""Complex parameters (issue 57): a Fourier layer's ``torch.cfloat`` weights through
``torch.fft``, trained with Adam, which steps a complex parameter as its (real, imaginary)
pairs. They train, record and gate in every row where torch supports them; where it does not,
the row says so in words: ZeRO-2 flattens a param group into one buffer of one dtype, and
torch's FSDP2 takes one dtype per unit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hookbench import Workload, gate
from hookbench.core import fsdp
from hookbench.engines import fsdp2
from hookbench.gate import baselines, rows, workload_checks
from hookbench.measure.parity import compare


class Spectral(nn.Module):
    """A Fourier neural operator's layer: complex weights on the lowest modes, real lifting
    and projection around them."""

    def __init__(self, width: int = 4, modes: int = 3) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(width, width, modes, dtype=torch.cfloat) / width)
        self.lift = nn.Linear(1, width)
        self.proj = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x).transpose(1, 2)
        f = torch.fft.rfft(h)
        out = torch.zeros_like(f)
        out[..., :self.modes] = torch.einsum("bim,iom->bom", f[..., :self.modes], self.weight)
        h = torch.fft.irfft(out, n=h.shape[-1]) + h
        return self.proj(F.gelu(h).transpose(1, 2))


def fields(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 16, 1, generator=g)
    return x, x.cumsum(1) / 4


def by_dtype(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.is_complex()]},
            {"params": [p for p in params if not p.is_complex()]}]


FNO = Workload("fno", model=Spectral, batch=fields, loss=F.mse_loss,
               optimizer=(torch.optim.Adam, {"lr": 1e-2}))
# complex and real parameters kept apart, as ZeRO-2's groups and FSDP2's units need
FNO_APART = FNO.replace(name="fno-apart", param_groups=by_dtype, fsdp2={"units": nn.Linear})


def test_a_complex_tensor_is_compared_whole_and_stored_whole():
    a = {"w": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.cfloat)}
    b = {"w": a["w"] + torch.tensor([0, 1e-3j], dtype=torch.cfloat)}  # the imaginary part only
    assert not compare([a], [b]).bit_exact
    assert compare([a], [b]).max_abs == pytest.approx(1e-3, rel=1e-3)
    stored = baselines.fingerprint([a])
    assert stored["final"]["w"]["values"] == [1.0, 2.0, 3.0, -1.0]  # JSON has no complex
    assert torch.equal(baselines.final_parameters(stored)["w"], a["w"])
    sampled = baselines.fingerprint([a], sample=1)["final"]["w#norm"]["values"][0]
    assert sampled == pytest.approx(float(torch.linalg.vector_norm(a["w"].to(torch.cdouble))))


def test_the_rows_say_where_torch_and_zero2_take_one_dtype():
    assert rows.refusal(FNO, "zero2") == (
        "ZeRO-2 refuses param group 0 mixing complex64 and float32: each param group is one "
        "flat buffer of one dtype (declare param_groups that keep them apart)")
    assert fsdp2.mixed_unit(FNO).endswith(": the root holds complex64 and float32; declare "
                                          "units that keep them apart (fsdp2={'units': ...})")
    assert rows.refusal(FNO_APART, "zero2") is None and fsdp2.mixed_unit(FNO_APART) is None


@pytest.mark.distributed
def test_torchs_fsdp2_refuses_a_unit_of_two_dtypes_in_plain_torch():
    """What ``fsdp2.mixed_unit`` says is torch's: ``fully_shard`` over complex and real
    parameters, one rank, no hookbench around it, fails at its first forward."""
    reason = fsdp2.cannot_train_on_cpu()
    if reason:
        pytest.skip(f"this torch's FSDP2 cannot train on CPU ranks: {reason}")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = Spectral()
    try:
        fsdp.api().fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(AssertionError, match="FSDP expects uniform original parameter "
                                                 "dtype"):
            model(fields(torch.Generator().manual_seed(0))[0])
    finally:
        fsdp2.remove_hooks(model)
        dist.destroy_process_group()


@pytest.mark.distributed
def test_complex_parameters_train_and_hold_in_every_row():
    got = workload_checks.measure_all([FNO, FNO_APART])
    assert not gate.failures({"workloads": got})
    # the apart one trains in every row, ZeRO-2 and FSDP2 included, on complex parameters
    assert not [k for k, v in got.items() if k.startswith("fno-apart/")
                and ({"refused", "not_applicable", "torch_refuses"} & set(v))]
    assert got["fno-apart/zero2"]["parity"].startswith("vs DDP on the same shares: bit-exact")
    assert got["fno/zero2"]["refused"].startswith("ValueError: param group 0 mixes dtypes")
    assert "the root holds complex64" in got["fno/engines/fsdp2_zero2"]["not_applicable"]


def test_a_pure_precision_refuses_complex_parameters():
    with pytest.raises(ValueError, match="builds complex parameters under precision='bf16-true'; "
                                         "torch has no complex bfloat16"):
        FNO.replace(precision="bf16-true").check()
