"""The arguments of publishers that do not wait (issue 30, item 5): an agent's ``keep_results``
and a submission's ``delay``, checked before anything runs or is sent; and which undelivered
answers are a publisher gone (counted) rather than a fault (dead-lettered)."""

from __future__ import annotations

import math

import pytest

from waystation.agent import App, TaskContext
from waystation.brokers.port import Unroutable, Unsendable
from waystation.events import Complete, Outcome
from waystation.policies import MAX_DELAY, PolicyError, delay_step
from waystation.protocol.wire import Names, ResultEnvelope, cancel_message, result_message
from waystation.runtime.settle import to_gone_publisher


def test_keep_results_is_declared_shown_and_checked() -> None:
    app = App()

    @app.agent("keeper", keep_results=True)
    async def keeper(task: TaskContext) -> Outcome:
        return Complete(None)

    @app.agent("plain")
    async def plain(task: TaskContext) -> Outcome:
        return Complete(None)

    assert app["keeper"].keep_results and not app["plain"].keep_results
    assert app["keeper"].policy(5)["keep_results"] is True
    assert app["plain"].policy(5)["keep_results"] is False
    with pytest.raises(PolicyError, match="keep_results"):
        app.agent("odd", keep_results="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "step"), [(0, 0), (0.05, 100), (2, 2000), (2.5, 3000), (MAX_DELAY, 70_000_000)]
)
def test_a_delay_waits_in_the_step_not_shorter_than_it(seconds: float, step: int) -> None:
    assert delay_step(seconds) == step


@pytest.mark.parametrize("seconds", [-1, -0.001, math.nan, math.inf, MAX_DELAY + 1, True, "2"])
def test_a_delay_that_cannot_be_one_is_refused(seconds: object) -> None:
    with pytest.raises(ValueError, match="delay must be"):
        delay_step(seconds)  # type: ignore[arg-type]


def test_only_a_result_to_a_publishers_queue_is_a_publisher_gone() -> None:
    names = Names("p.")
    gone = Unroutable("m", "client.x")
    result = result_message("t", "p.client.123", None, ResultEnvelope("ok", result=1))
    assert to_gone_publisher(result, gone)
    # a reply to a paused task's call: the agent's own reply queue, or one of its shards
    for queue in (names.replies("boss"), names.reply_shard("boss", 3)):
        reply = result_message("t:1:0", queue, "t:1:0", ResultEnvelope("ok", result=1))
        assert not to_gone_publisher(reply, gone)
    # a message that is not a result (a cancel for a peer), or one refused for another reason
    assert not to_gone_publisher(cancel_message(names, "t:1:0", "peer", "why", {}), gone)
    too_large = Unsendable("m", "too big", reason="too-large")
    assert not to_gone_publisher(result, too_large)
