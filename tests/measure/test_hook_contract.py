"""The PyTorch hook behaviours hookbench relies on hold on the installed torch."""

import pytest
import torch

from hookbench.measure.hook_contract import (
    CHECKS,
    ContractViolation,
    _expect,
    full_backward_hooks,
    run_all,
)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.smoke
def test_contract(check):
    check()


def test_run_all_reports_every_check_by_name():
    assert run_all() == {c.__name__: None for c in CHECKS}


def test_a_violation_is_an_assertion_error_with_its_message():
    with pytest.raises(AssertionError, match="pinned"):
        _expect(False, "pinned")
    assert issubclass(ContractViolation, AssertionError)


def test_the_full_backward_hook_pin_fails_when_the_hook_fires_twice(monkeypatch):
    register = torch.nn.Module.register_full_backward_hook

    def twice(self, hook, *args, **kwargs):
        return register(self, lambda m, gi, go: (hook(m, gi, go), hook(m, gi, go))[0],
                        *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "register_full_backward_hook", twice)
    with pytest.raises(ContractViolation, match=r"fired \['pre', 'hook', 'hook'\]"):
        full_backward_hooks()
