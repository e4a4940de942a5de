"""The PyTorch hook behaviours hookbench relies on hold on the installed torch."""

import pytest

from hookbench.hook_contract import CHECKS, ContractViolation, _expect, run_all


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_contract(check):
    check()


def test_run_all_reports_every_check_by_name():
    assert run_all() == {c.__name__: None for c in CHECKS}


def test_a_violation_is_an_assertion_error_with_its_message():
    with pytest.raises(AssertionError, match="pinned"):
        _expect(False, "pinned")
    assert issubclass(ContractViolation, AssertionError)
