"""microsoft/mup as a peer: on the same graph, initialisation, data and seeds, hookbench's muP
coordinates equal the library's (``MuReadout``, ``set_base_shapes``, ``MuAdam``,
``get_coord_data``). Skipped with a reason where the ``mup`` extra is not installed; the
comparison is shown to fail on hookbench's old readout in tests/models/test_mup.py."""

import pytest
import torch

pytest.importorskip("mup", reason="microsoft/mup is an optional peer: pip install -e '.[mup]'")

from hookbench.measure.coord_check import coord_check  # noqa: E402
from hookbench.measure.peers import microsoft_mup  # noqa: E402

pytestmark = pytest.mark.peers

# float64 rounding: 2^-53. The transformer's attention is the one operation that differs
# (SDPA in hookbench; q.k^T * attn_mult / d_head, softmax, @ v written out in the library's
# way): each attention output sums the same <= 16 keys x d_head <= 128 products in another
# order, a relative difference of at most ~(16 + 128) 2^-53 = 1.6e-14 per output. Later
# layers carry it through at about 1:1, and so does Adam, whose update lr m / (sqrt(v) + eps)
# is a ratio of the gradient's own moments. 1e-12 leaves a margin of about 50x over that and
# sits ten orders of magnitude below any parametrization difference (a factor sqrt(2) at the
# first width doubling). Seen: 8.6e-16 (zero readout) and 4.8e-14 (random readout). In
# float32 the same comparison differs by 2.9e-6 and 2.1e-5 (docs/activation-capture.md).
TRANSFORMER_RTOL = 1e-12
OPTIONS = [True, False]
IDS = ["zero-readout", "mureadout-init"]


@pytest.fixture
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _difference(model, readout_zero_init):
    return microsoft_mup.difference(
        coord_check(model, "mup", readout_zero_init=readout_zero_init),
        microsoft_mup.coordinates(model, readout_zero_init=readout_zero_init))


@pytest.mark.parametrize("readout_zero_init", OPTIONS, ids=IDS)
def test_mlp_coordinates_equal_the_library_bit_for_bit(readout_zero_init):
    # Identical arithmetic in fp32 (the same Linear kernels, x / m, lr / m, for-loop Adam), and
    # both take the float64 mean of the same values: every coordinate is the same number.
    assert _difference("mlp", readout_zero_init) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("readout_zero_init", OPTIONS, ids=IDS)
def test_transformer_coordinates_equal_the_library_to_rounding(float64, readout_zero_init):
    assert _difference("transformer", readout_zero_init) <= TRANSFORMER_RTOL


def test_library_model_is_the_library_s_mup():
    # What the comparison relies on: the library's readout (rescaled once, by sqrt(m)) and its
    # optimizer's hidden learning rate lr / m, at 4x the base width.
    net = microsoft_mup.library_model("mlp", 128, 32, seed=0)
    assert net.out.width_mult() == 4 and net.out._has_rescaled_params
    groups = __import__("mup").MuAdam(net.parameters(), lr=0.1).param_groups
    assert sorted(g["lr"] for g in groups) == [0.025, 0.1]
