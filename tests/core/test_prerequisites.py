"""How a row words an exception (``hookbench.core.prerequisites.one_line``)."""

from __future__ import annotations

import pytest

from hookbench.core.prerequisites import one_line, warnings_kept


def _bare_assert() -> None:
    raise AssertionError  # torch's own style in places (the batched PowerSGD hook)


def test_an_exception_is_its_type_and_the_first_line_of_its_message():
    assert one_line(ValueError("\n  first\nsecond")) == "ValueError: first"


def test_an_exception_without_a_message_says_where_it_was_raised():
    with pytest.raises(AssertionError) as caught:
        _bare_assert()
    assert one_line(caught.value) == (
        f"AssertionError: (no message) raised in _bare_assert, test_prerequisites.py:"
        f"{_bare_assert.__code__.co_firstlineno + 1}")
    # never raised, so nowhere to point at: the type alone
    assert one_line(AssertionError()) == "AssertionError: "


def test_every_deepspeed_install_command_is_the_one_ci_runs():
    # The skip messages, pyproject.toml's peers comment and .ci/run give one command.
    from pathlib import Path

    from hookbench.core.deepspeed_import import MISSING
    from hookbench.core.prerequisites import DEEPSPEED_INSTALL

    root = Path(__file__).resolve().parent.parent.parent
    assert DEEPSPEED_INSTALL in MISSING
    assert DEEPSPEED_INSTALL.split("pip ", 1)[1] in (root / ".ci" / "run").read_text()
    assert f"# {DEEPSPEED_INSTALL}" in (root / "pyproject.toml").read_text()


def test_torchs_log_records_go_into_the_row_not_onto_the_terminal(capfd):
    """torch's warnings by its loggers (a rank's "No CUDA runtime is found" on a compiled
    workload, once per rank) are said in the row as warnings are, and printed nowhere."""
    import logging

    said: list[str] = []
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    handlers = logging.getLogger("torch").handlers[:]
    with warnings_kept(said):
        torch_log.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'")
        torch_log.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'")
        torch_log.info("an info line is not a warning")
    assert said == ["torch log: No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'"]
    assert capfd.readouterr().err == ""
    assert logging.getLogger("torch").handlers == handlers  # restored
