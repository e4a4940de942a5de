"""The muP and SP parametrizations: learning rates, readout multiplier, attention scale."""

import pytest
import torch

from hookbench import mup


@pytest.mark.parametrize("cls", [mup.MLP, mup.Transformer])
def test_hidden_matrices_get_lr_over_width_multiplier_in_mup_only(cls):
    m = cls(128, "mup", base_width=32)
    hidden, rest = mup.param_groups(m, lr=0.1)
    assert hidden["lr"] == pytest.approx(0.1 / 4) and rest["lr"] == 0.1
    assert all(p.dim() == 2 and min(p.shape) >= 128 for p in hidden["params"])
    assert len(hidden["params"]) + len(rest["params"]) == len(list(m.parameters()))
    assert {g["lr"] for g in mup.param_groups(cls(128, "sp", base_width=32), lr=0.1)} == {0.1}


def test_readout_multiplier_and_base_width_equivalence():
    torch.manual_seed(0)
    mu = mup.MLP(32, "mup", base_width=32)
    torch.manual_seed(0)
    sp = mup.MLP(32, "sp", base_width=32)
    x = torch.randn(4, 16)
    # At the base width muP and SP are the same model.
    assert torch.equal(mu(x), sp(x))
    assert mup.MLP(128, "mup", base_width=32).out.multiplier == 1 / 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="parametrization must be one of"):
        mup.MLP(32, "ntk")
    with pytest.raises(ValueError, match="not divisible by heads"):
        mup.Transformer(30, heads=4)
    with pytest.raises(ValueError, match=">= 1"):
        mup.MLP(0)
