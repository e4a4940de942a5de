"""The muP coordinate check: muP models pass, the same models in standard parametrization at the
same learning rate fail (the positive control that shows the check can fail)."""

import pytest

from hookbench import plot
from hookbench.coord_check import coord_check


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(model, parametrization):
        if (model, parametrization) not in cache:
            cache[model, parametrization] = coord_check(model, parametrization)
        return cache[model, parametrization]

    return get


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_mup_passes(results, model):
    r = results(model, "mup")
    assert r.passed, r.verdict()
    assert r.widths[-1] == 16 * r.widths[0] and r.seeds == 3
    # Not only inside the band: the widest model's coordinates stay the same order as the
    # narrowest's at every step for every layer (seen: at most 1.54x, MLP layers.1, step 3).
    assert max(r.growth(layer, t) for layer in r.coords for t in range(r.steps + 1)) < 2.0


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_standard_parametrization_fails_at_the_same_learning_rate(results, model):
    r = results(model, "sp")
    assert not r.passed, r.verdict()
    # At initialisation both parametrizations are fine (init variance 1/fan_in); the blow-up
    # comes with the first Adam update, whose effect on hidden layers grows with width.
    assert all(r.growth(layer, 0) <= r.band for layer in r.coords)
    assert {t for _, t, _ in r.failures} <= {1, 2, 3}
    assert "FAIL" in r.verdict()


def test_plot_is_written(results, tmp_path):
    path = plot.coord_check(results("mlp", "sp"), tmp_path / "coord.png")
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("kwargs, match", [
    (dict(model="cnn"), "model must be one of"),
    (dict(widths=(64,)), "at least two increasing"),
    (dict(widths=(64, 32)), "at least two increasing"),
    (dict(steps=0), "steps and seeds must be >= 1"),
    (dict(parametrization="ntk"), "parametrization must be one of"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        coord_check(**kwargs)
