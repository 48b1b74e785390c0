"""labkit.lab.expect: a failed hidden check raises under LABKIT_STRICT, and prints one line for a student.

PYTEST_DONT_REWRITE: the checks' asserts here fail as a lesson's do in a kernel, with their own message
(pytest's rewriting would put its introspection into the line a student reads).
"""

import pytest

from labkit.lab import expect
from labkit.lab.checks import STRICT_ENV

WHAT = "the unclipped run stops making progress while the clipped one trains"


def fail_with(kind):
    """Run a check whose body fails the way a lesson's can: an assert, an index not found, a lookup..."""
    if kind == "assert":
        assert 34 == 39, "first skip at step 39"
    if kind == "index":
        [34, 35].index(39)
    if kind == "key":
        {}["nonfinite_grad"]
    if kind == "zero":
        _ = 1 / 0
    if kind == "multiline":
        raise RuntimeError("first line\n  second line\n")


KINDS = {"assert": "first skip at step 39", "index": "39 is not in list", "key": "'nonfinite_grad'",
         "zero": "division by zero", "multiline": "first line second line"}


@pytest.mark.parametrize("strict", ["1", "yes"])
@pytest.mark.parametrize("kind", KINDS)
def test_strict_raises_an_assertion_error_naming_what_and_why(kind, strict, monkeypatch):
    monkeypatch.setenv(STRICT_ENV, strict)
    with pytest.raises(AssertionError, match=f"^lesson check failed: {WHAT} ") as failure, expect(WHAT):
        fail_with(kind)
    original = failure.value.__cause__
    assert original is not None and type(original).__name__ in str(failure.value)


@pytest.mark.parametrize("off", [None, "", "0"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_students_kernel_prints_one_line_and_goes_on(kind, off, monkeypatch, capsys):
    if off is None:
        monkeypatch.delenv(STRICT_ENV, raising=False)
    else:
        monkeypatch.setenv(STRICT_ENV, off)
    went_on = False
    with expect(WHAT):
        fail_with(kind)
    went_on = True
    out, err = capsys.readouterr()
    assert went_on and err == ""
    assert out == (f"check not met on this machine: {WHAT} ({KINDS[kind]}); "
                   "the text may not match this run.\n")


def test_a_bare_assert_names_its_type(monkeypatch, capsys):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    with expect(WHAT):
        assert False  # noqa: B011 (the bare assert is what is tested)
    assert capsys.readouterr().out == f"check not met on this machine: {WHAT} (AssertionError); " \
                                      "the text may not match this run.\n"


@pytest.mark.parametrize("strict", [True, False])
def test_a_check_that_holds_is_silent_either_way(strict, monkeypatch, capsys):
    monkeypatch.setenv(STRICT_ENV, "1" if strict else "0")
    with expect(WHAT):
        assert 1 < 2
    assert capsys.readouterr() == ("", "")


def test_an_interrupt_is_not_a_failed_check(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    # the student stopped the kernel: the lesson stops
    with pytest.raises(KeyboardInterrupt), expect(WHAT):
        raise KeyboardInterrupt
