"""The suite's seeding (conftest.py): a test, and a fixture of a wider scope, start from seed 0
whatever ran before them (torch seeds its generator at random in each process), and leave the
global RNGs as they found them."""

from __future__ import annotations

import random

import pytest
import torch


# A draw at collection, as a module's constant would make: it moves the global RNGs on, so a
# fixture set up after it, unseeded, would draw other numbers than seed 0's.
torch.rand(1), random.random()


def _seed_0() -> tuple[torch.Tensor, float]:
    return torch.rand(3, generator=torch.Generator().manual_seed(0)), random.Random(0).random()


@pytest.fixture(scope="module")
def drawn_by_a_module_fixture() -> tuple[torch.Tensor, float]:
    return torch.rand(3), random.random()


@pytest.mark.parametrize("run", range(2))  # the second test finds the fixture made already
def test_a_module_fixture_draws_from_seed_0(drawn_by_a_module_fixture, run):
    torch.rand(5), random.random()  # draws of this test: gone at its end
    drawn, expected = drawn_by_a_module_fixture, _seed_0()
    assert torch.equal(drawn[0], expected[0]) and drawn[1] == expected[1]


def test_a_test_draws_from_seed_0():
    expected = _seed_0()
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
