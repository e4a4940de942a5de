"""The leak guard names every kind of hook left behind, and fails the test that left it."""

import gc
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod

from hookbench.core.leak_guard import HookLeakGuard, HookTracker, untracked

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]

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
        assert len(leaks) == 1 and leaks[0].startswith(f"1 {kind}(s)"), leaks
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


def test_guard_sees_a_hook_replaced_on_an_object_built_before_it():
    # Same count of hooks before and after, but another hook: compared by id, it is a leak.
    tracker = HookTracker().install()
    try:
        model = nn.Linear(2, 2)
        first = model.register_forward_hook(lambda *a: None)
        with HookLeakGuard(tracker) as guard:
            first.remove()
            second = model.register_forward_hook(lambda *a: None)
        assert guard.leaks() == ["1 forward hook(s) on Linear"]
        second.remove()
        assert guard.leaks() == []
    finally:
        tracker.uninstall()


def test_tracking_keeps_no_model_alive():
    with untracked():  # nor may this test's own guard, which holds what the test builds
        tracker = HookTracker().install()
        try:
            model = nn.Sequential(nn.Linear(2, 2))
            model.register_forward_hook(lambda *a: None)
            with HookLeakGuard(tracker) as guard:
                model[0].register_forward_hook(lambda *a: None)
            assert guard.leaks() == ["1 forward hook(s) on Linear '0'"]
            dead = weakref.ref(model)
            del model
            gc.collect()
            assert dead() is None
            assert tracker.hooks() == {} and guard.leaks() == []
        finally:
            tracker.uninstall()


# -- The real conftest.py on small inline test files, run in this process ------------------------

CONFTEST = (ROOT / "conftest.py").read_text()


def run_with_conftest(pytester, files: dict[str, str], conftest_extra: str = ""):
    pytester.makeconftest(CONFTEST + textwrap.dedent(conftest_extra))
    pytester.makepyfile(**{name: textwrap.dedent(text) for name, text in files.items()})
    # The inner session's guard judges the leaks these files make on purpose; this test's own
    # guard must not see what the inner session builds.
    with untracked():
        return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-v")


def test_conftest_guard_fails_a_test_leaking_on_a_model_it_built(pytester):
    result = run_with_conftest(pytester, {"test_local": """
        import torch
        def test_leaks():
            model = torch.nn.Linear(2, 2)
            model.register_forward_hook(lambda *a: None)
        def test_clean():
            model = torch.nn.Linear(2, 2)
            model.register_forward_hook(lambda *a: None).remove()
    """})
    result.assert_outcomes(passed=2, errors=1)  # the leaking test passes its body, fails teardown
    result.stdout.fnmatch_lines([
        "test_local.py::test_leaks PASSED*",
        "test_local.py::test_leaks ERROR*",
        "test_local.py::test_clean PASSED*",
        "*ERROR at teardown of test_leaks*",
        "*hooks left registered after the test:",
        "*1 forward hook(s) on Linear",
    ])


def test_hook_left_on_a_module_scoped_fixture_fails_the_test_that_left_it(pytester):
    result = run_with_conftest(pytester, {"test_module_fixture": """
        import pytest, torch
        @pytest.fixture(scope="module")
        def linear():
            return torch.nn.Linear(2, 2)
        def test_a(linear):
            linear.register_forward_hook(lambda *a: None)
        def test_b(linear):
            assert len(linear._forward_hooks) == 1  # test_a's, still there: why it must fail
    """})
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "test_module_fixture.py::test_a PASSED*",
        "test_module_fixture.py::test_a ERROR*",
        "test_module_fixture.py::test_b PASSED*",
        "*ERROR at teardown of test_a*",
        "*hooks left registered after the test:",
        "*1 forward hook(s) on Linear",
    ])
    assert "ERROR at teardown of test_b" not in result.stdout.str()


def test_hook_left_on_a_session_scoped_fixture_fails_the_test_that_left_it(pytester):
    fixture = """
        @pytest.fixture(scope="session")
        def shared():
            return torch.nn.Sequential(torch.nn.Linear(2, 2))
    """
    result = run_with_conftest(pytester, {
        "test_one": """
            def test_a(shared):
                shared[0].register_forward_pre_hook(lambda *a: None)
        """,
        "test_two": """
            def test_b(shared):
                shared(__import__("torch").ones(1, 2))
        """,
    }, conftest_extra=fixture)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "test_one.py::test_a PASSED*",
        "test_one.py::test_a ERROR*",
        "test_two.py::test_b PASSED*",
        "*ERROR at teardown of test_a*",
        "*1 forward-pre hook(s) on Linear '0'",
    ])


def test_hook_left_on_a_model_built_at_import_fails_the_test_that_left_it(pytester):
    result = run_with_conftest(pytester, {"test_import_time": """
        import torch
        MODEL = torch.nn.Linear(2, 2)  # built while the module is collected
        def test_a():
            MODEL.bias.register_hook(lambda g: None)
        def test_b():
            pass
    """})
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "test_import_time.py::test_a ERROR*",
        "*ERROR at teardown of test_a*",
        "*1 tensor (grad) hook(s) on parameter 'bias' of Linear",
    ])


def test_global_hook_left_by_a_test_fails_it(pytester):
    result = run_with_conftest(pytester, {"test_global": """
        from torch.nn.modules import module as module_mod
        HANDLES = []
        def test_a():
            HANDLES.append(module_mod.register_module_forward_hook(lambda *a: None))
        def test_b():
            HANDLES.pop().remove()  # so that the global hook does not outlive this inner run
    """})
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "test_global.py::test_a ERROR*",
        "test_global.py::test_b PASSED*",
        "*ERROR at teardown of test_a*",
        "*1 global forward hook(s)",
    ])


def test_post_accumulate_grad_hook_left_on_a_fixtures_parameter_fails_the_test(pytester):
    result = run_with_conftest(pytester, {"test_param": """
        import pytest, torch
        @pytest.fixture(scope="module")
        def linear():
            return torch.nn.Linear(2, 2)
        def test_a(linear):
            linear.weight.register_post_accumulate_grad_hook(lambda p: None)
        def test_b(linear):
            linear(torch.ones(1, 2)).sum().backward()
    """})
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "test_param.py::test_a ERROR*",
        "test_param.py::test_b PASSED*",
        "*ERROR at teardown of test_a*",
        "*1 post-accumulate-grad hook(s) on parameter 'weight' of Linear",
    ])


def test_fixture_that_never_removes_its_hook_errors_at_its_teardown(pytester):
    # No test leaked anything: the module- and the session-scoped fixtures did, in setup.
    result = run_with_conftest(pytester, {
        "test_a_module": """
            import pytest, torch
            @pytest.fixture(scope="module")
            def hooked():
                model = torch.nn.Linear(2, 2)
                model.register_forward_hook(lambda *a: None)
                return model
            def test_a(hooked):
                hooked(torch.ones(1, 2))
            def test_b(hooked):
                pass
        """,
        "test_b_session": """
            def test_c(hooked_for_session):
                pass
        """,
    }, conftest_extra="""
        @pytest.fixture(scope="session")
        def hooked_for_session():
            model = torch.nn.Linear(2, 2)
            model.weight.register_post_accumulate_grad_hook(lambda p: None)
            yield model
    """)
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines([
        "test_a_module.py::test_a PASSED*",
        "test_a_module.py::test_b PASSED*",
        "test_a_module.py::test_b ERROR*",
        "test_b_session.py::test_c PASSED*",
        "test_b_session.py::test_c ERROR*",
        "*ERROR at teardown of test_b*",
        "*hooks left registered after the teardown of module-scoped fixture 'hooked':",
        "*1 forward hook(s) on Linear",
        "*ERROR at teardown of test_c*",
        "*hooks left registered after the teardown of session-scoped fixture "
        "'hooked_for_session':",
        "*1 post-accumulate-grad hook(s) on parameter 'weight' of Linear",
    ])


def test_fixtures_that_remove_their_hooks_pass(pytester):
    result = run_with_conftest(pytester, {"test_clean_fixtures": """
        import pytest, torch
        @pytest.fixture(scope="module")
        def hooked():
            model = torch.nn.Linear(2, 2)
            handle = model.register_forward_hook(lambda *a: None)
            try:
                yield model
            finally:
                handle.remove()
        @pytest.fixture(scope="module")
        def finalized(request):
            model = torch.nn.Linear(2, 2)
            request.addfinalizer(
                model.weight.register_post_accumulate_grad_hook(lambda p: None).remove)
            return model
        def test_a(hooked, finalized):
            hooked(torch.ones(1, 2))
        def test_b(hooked, finalized, request):
            # A module fixture first set up in the middle of a test answers for its own hooks.
            request.getfixturevalue("late")
            hooked.register_forward_hook(lambda *a: None).remove()
        @pytest.fixture(scope="module")
        def late():
            model = torch.nn.Linear(2, 2)
            handle = model.register_full_backward_hook(lambda *a: None)
            yield model
            handle.remove()
    """})
    result.assert_outcomes(passed=2)


def test_fixture_hook_replaced_by_the_test_fails_the_test(pytester):
    # The hook count is what it was; the hook is another one.
    result = run_with_conftest(pytester, {"test_replace": """
        import pytest, torch
        @pytest.fixture(scope="module")
        def hooked():
            model = torch.nn.Linear(2, 2)
            handle = model.register_forward_hook(lambda *a: None)
            yield model, handle
            handle.remove()
        def test_a(hooked):
            model, handle = hooked
            handle.remove()
            model.register_forward_hook(lambda *a: None)
    """})
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_a*",
        "*hooks left registered after the test:",
        "*1 forward hook(s) on Linear",
    ])
    assert "fixture 'hooked'" not in result.stdout.str()
