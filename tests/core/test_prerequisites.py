"""How a row words an exception (``hookbench.core.prerequisites.one_line``)."""

from __future__ import annotations

import pytest

from hookbench.core.prerequisites import one_line


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
