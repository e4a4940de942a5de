"""The leak guard names every kind of hook left behind, and fails the test that left it."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod

from hookbench.leak_guard import HookLeakGuard

ROOT = Path(__file__).resolve().parent.parent

LEAKS = {
    "forward hook": lambda m: m[0].register_forward_hook(lambda *a: None),
    "forward-pre hook": lambda m: m[0].register_forward_pre_hook(lambda *a: None),
    "backward hook": lambda m: m[0].register_full_backward_hook(lambda *a: None),
    "backward-pre hook": lambda m: m[0].register_full_backward_pre_hook(lambda *a: None),
    "post-accumulate-grad hook": lambda m: m[0].weight.register_post_accumulate_grad_hook(
        lambda t: None),
    "tensor (grad) hook": lambda m: m[0].bias.register_hook(lambda g: None),
    "global forward hook": lambda m: module_mod.register_module_forward_hook(lambda *a: None),
    "global forward-pre hook": lambda m: module_mod.register_module_forward_pre_hook(
        lambda *a: None),
    "global backward hook": lambda m: module_mod.register_module_full_backward_hook(
        lambda *a: None),
    "global backward-pre hook": lambda m: module_mod.register_module_full_backward_pre_hook(
        lambda *a: None),
}


@pytest.mark.parametrize("kind", LEAKS)
def test_guard_names_a_leaked(kind):
    with HookLeakGuard() as guard:
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        handle = LEAKS[kind](model)
    try:
        leaks = guard.leaks()
        assert len(leaks) == 1 and kind in leaks[0], leaks
    finally:
        handle.remove()
    assert guard.leaks() == []


def test_guard_passes_when_hooks_are_removed_and_ignores_earlier_models():
    earlier = nn.Linear(2, 2)
    kept = earlier.register_forward_hook(lambda *a: None)  # not the guarded code's doing
    try:
        with HookLeakGuard() as guard:
            model = nn.Linear(2, 2)
            model.register_forward_hook(lambda *a: None).remove()
            model(torch.ones(1, 2))
        assert guard.leaks() == []
    finally:
        kept.remove()


def test_conftest_guard_fails_a_leaking_test(tmp_path):
    # The real conftest.py, run on a test that leaks: it must fail and name the leak.
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent("""
        import torch
        def test_leaks():
            model = torch.nn.Linear(2, 2)
            model.register_forward_hook(lambda *a: None)
        def test_clean():
            model = torch.nn.Linear(2, 2)
            model.register_forward_hook(lambda *a: None).remove()
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "2 passed, 1 error" in out, out  # the leaking test passes its body, fails teardown
    assert "ERROR at teardown of test_leaks" in out, out
    assert "1 forward hook(s) on Linear" in out, out
