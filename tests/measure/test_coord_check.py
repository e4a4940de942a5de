"""The muP coordinate check, two-sided: muP models pass, the same models in standard
parametrization at the same learning rate fail (grow), and injected muP bugs that only shrink
a coordinate fail too, which a growth-only check (hookbench's before issue 11) lets pass."""

import math

import pytest
from torch import nn

from hookbench.measure import plot
from hookbench.measure.coord_check import coord_check, ratios
from hookbench.models import mup


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(model, parametrization, **kwargs):
        key = (model, parametrization, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = coord_check(model, parametrization, **kwargs)
        return cache[key]

    return get


def _largest_growth(r):
    return max(up for *_, up, _down in r.cells())


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_mup_passes_both_ways(results, model):
    r = results(model, "mup")
    assert r.passed, r.verdict()
    assert r.widths[-1] == 16 * r.widths[0] and r.seeds == 3 and r.readout_zero_init
    # Not only inside the band: seen at most 1.11x growth and 1.57x shrinkage (the
    # transformer's logits at step 1).
    assert max(max(up, down) for *_, up, down in r.cells()) < 1.75, r.verdict()


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_standard_parametrization_fails_at_the_same_learning_rate(results, model):
    r = results(model, "sp")
    assert not r.passed, r.verdict()
    # At initialisation both parametrizations are the same (init variance 1/fan_in, zero
    # readout); the blow-up comes with the updates, whose effect grows with width in SP.
    assert {t for _, _, t, _, _ in r.failures} <= {1, 2, 3}
    assert {way for *_, way, _ in r.failures} == {"grows"}
    assert "FAIL" in r.verdict()


@pytest.fixture
def double_readout_multiplier(monkeypatch):
    """A classic muP bug: the 1/m readout multiplier applied twice (MuReadout plus the user's
    own), so the logits and their updates shrink as 1/m."""
    monkeypatch.setattr(mup.Readout, "forward",
                        lambda self, x: nn.Linear.forward(self, x / self.width_mult ** 2))


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_a_shrinking_coordinate_fails_where_a_growth_only_check_passes(model,
                                                                      double_readout_multiplier):
    r = coord_check(model, "mup")
    # The check before issue 11 measured growth only: it would pass this model.
    assert _largest_growth(r) <= r.band, r.verdict()
    assert not r.passed and "FAIL" in r.verdict()
    # Seen: the logits shrink 5.0x to 7.7x across 16x width; nothing else leaves the band.
    assert {(layer, way) for layer, _, _, way, _ in r.failures} == {("out", "shrinks")}
    assert all(t >= 1 for _, _, t, _, _ in r.failures)


@pytest.fixture
def hidden_lr_over_m_squared(monkeypatch):
    """Another: the hidden learning rate scaled by 1/m twice (param_groups plus MuAdam)."""
    groups = mup.param_groups

    def doubled(model, lr):
        hidden, rest = groups(model, lr)
        return [{**hidden, "lr": hidden["lr"] / model.m}, rest]

    monkeypatch.setattr(mup, "param_groups", doubled)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_too_small_hidden_updates_are_seen_in_the_change_not_the_coordinate(
        model, hidden_lr_over_m_squared):
    r = coord_check(model, "mup")
    assert not r.passed, r.verdict()
    # Each output is still its Theta(1) initial value, so the coordinate alone passes (seen:
    # at most 1.66x); the change since initialisation shrinks (seen 2.2x to 5.4x).
    assert {q for _, q, _, _, _ in r.failures} == {"change"}
    assert {way for *_, way, _ in r.failures} == {"shrinks"}


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_random_readout_init_logits_vanish_as_width_to_the_minus_half(results, model):
    """With MuReadout's default random init the logits at initialisation are Theta(m^-1/2)
    (effective variance ~ fan_in^-2): over 16x width they shrink sqrt(16) = 4x, which is why
    the check zero-initialises the readout, as mup's own does (seen 4.11x and 4.02x)."""
    r = results(model, "mup", readout_zero_init=False)
    assert r.shrink("out", 0) == pytest.approx(4.0, rel=0.06)
    assert ("out", "coordinate", 0, "shrinks") in {f[:4] for f in r.failures}


def test_ratios_both_ways_and_degenerate_rows():
    assert ratios([2.0, 4.0, 1.0]) == (2.0, 2.0)
    assert ratios([0.0, 0.0]) == (1.0, 1.0)  # exactly zero at every width: flat
    assert ratios([0.0, 1.0]) == (math.inf, 1.0)
    assert ratios([1.0, 0.0]) == (1.0, math.inf)
    assert ratios([1.0, math.nan]) == (math.inf, math.inf)


def test_plot_is_written(results, tmp_path):
    path = plot.coord_check(results("mlp", "sp"), tmp_path / "coord.png")
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("kwargs, match", [
    (dict(model="cnn"), "model must be one of"),
    (dict(widths=(64,)), "at least two increasing"),
    (dict(widths=(64, 32)), "at least two increasing"),
    (dict(steps=0), "steps and seeds must be >= 1"),
    (dict(band=1.0), "band must be > 1"),
    (dict(parametrization="ntk"), "parametrization must be one of"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        coord_check(**kwargs)
