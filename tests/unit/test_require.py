"""``tests.support.require``: the one place that decides whether a test that cannot run skips
(locally, saying what is missing) or fails (under CI, where a skip would pass unnoticed)."""

from __future__ import annotations

import pytest

from ..support import Capability, require

MISSING = Capability("rabbitmqctl", "rabbitmqctl is not on PATH (install rabbitmq-server here)")
WHAT_IS_MISSING = (
    "closing a broker connection needs rabbitmqctl, but rabbitmqctl is not on PATH "
    "(install rabbitmq-server here)"
)


def ci_is(value: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)


def outcome_of_requiring(capability: Capability) -> BaseException:
    """What ``require`` raised: caught whatever it is, so that a skip where a failure is due
    fails this test instead of skipping it."""
    with pytest.raises(BaseException) as raised:
        require(capability, "closing a broker connection")
    return raised.value


@pytest.mark.parametrize("ci", ["true", "1", "yes"])
def test_a_missing_capability_fails_under_ci(ci: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ci_is(ci, monkeypatch)
    outcome = outcome_of_requiring(MISSING)
    assert type(outcome) is pytest.fail.Exception, repr(outcome)
    assert str(outcome) == f"{WHAT_IS_MISSING} (under CI a missing capability fails)"


@pytest.mark.parametrize("ci", [None, ""])
def test_a_missing_capability_skips_locally_saying_exactly_what_is_missing(
    ci: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ci_is(ci, monkeypatch)
    outcome = outcome_of_requiring(MISSING)
    assert type(outcome) is pytest.skip.Exception, repr(outcome)
    assert str(outcome) == WHAT_IS_MISSING


@pytest.mark.parametrize("ci", [None, "true"])
def test_a_capability_that_is_here_lets_the_test_go_on(
    ci: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ci_is(ci, monkeypatch)
    require(Capability("rabbitmqctl"), "closing a broker connection")  # neither skips nor fails


def test_a_capability_has_no_truth_value_so_no_test_can_weaken_itself_quietly() -> None:
    for capability in (MISSING, Capability("rabbitmqctl")):
        with pytest.raises(TypeError, match="use require"):
            bool(capability)
