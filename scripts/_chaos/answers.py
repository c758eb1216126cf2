"""Every task answered as its kind expects (:func:`answer_figures`): by a result or a dead
letter, and every dead letter explained. What is missing, wrong or duplicated in the event log
is checked by :mod:`scripts.lab.harness.checks` (``log_figures``)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from scripts.lab.harness.checks import canonical_or_raw, results_by_task
from waystation.brokers.amqp.deadletters import DeadLetter
from waystation.events.codec import loads

from .plan import Expected

_SUBTASK = re.compile(r"^(?P<task>.+):\d+:\d+$")


def letter_task_id(letter: DeadLetter, tasks: Collection[str]) -> str | None:
    """The task (one of ``tasks``) a dead letter is about: its body's ``task_id`` (a result, a
    resume), its correlation id (a result's is its task's), its message id (``<task>:result``),
    or the task whose call it is (``<task>:<pause>:<i>``); None when none is a task."""
    candidates: list[Any] = []
    try:
        body = loads(letter.body)
        if isinstance(body, dict):
            candidates.append(body.get("task_id"))
    except Exception:
        pass
    candidates += [letter.correlation_id, letter.message_id]
    for candidate in candidates:
        if not isinstance(candidate, str):
            continue
        call = _SUBTASK.match(candidate)
        for name in (candidate, candidate.removesuffix(":result"), call and call["task"]):
            if name and name in tasks:
                return name
    return None


def decoded(body: bytes) -> Any:
    try:
        return loads(body)
    except Exception:
        return None


def _matches(expected: Expected, answer: Any) -> bool:
    """Whether a result message's body is the answer ``expected`` asks for: ``ok`` with the
    result, or an error of the type (its message may differ between two copies: it names
    what the broker said each time)."""
    if not isinstance(answer, dict):
        return False
    if expected.error_type is not None:
        error = answer.get("error")
        return (
            answer.get("status") == "error"
            and isinstance(error, dict)
            and error.get("type") == expected.error_type
        )
    return bool(answer.get("status") == "ok" and answer.get("result") == expected.result)


EXAMPLES = 5


@dataclass
class AnswerFigures:
    messages: int
    """Result messages received, repeats included."""
    answered: int
    """Tasks answered: with a result, or (``full-never``) with their dead letter."""
    by_result: int
    by_letter: int
    missing: list[str]
    """Tasks without any answer."""
    wrong: list[str]
    """Tasks answered otherwise than their kind expects (another result, an error of another
    type, two different results, a result where a dead letter was due or the reverse)."""
    duplicates: int
    """Result messages beyond the first of their task."""
    duplicates_redelivered: int
    """Of those, delivered again by the broker (the collector's ack died with its connection)."""
    duplicated_tasks: list[str]
    unexpected: int
    """Result messages of no submitted task."""
    letters: int
    """Dead letters of the tasks' messages."""
    unexplained_letters: list[str]
    """Dead letters of a task whose kind does not explain them, or of no task at all."""
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per kind: tasks, answered, by result, by dead letter."""

    @property
    def duplicates_published(self) -> int:
        return self.duplicates - self.duplicates_redelivered

    def to_json(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "answered": self.answered,
            "answered_by_result": self.by_result,
            "answered_by_dead_letter": self.by_letter,
            "missing": len(self.missing),
            "wrong": len(self.wrong),
            "duplicates": self.duplicates,
            "duplicates_redelivered_to_collector": self.duplicates_redelivered,
            "duplicates_published_again": self.duplicates_published,
            "unexpected": self.unexpected,
            "dead_letters_of_tasks": self.letters,
            "unexplained_dead_letters": len(self.unexplained_letters),
            "by_kind": self.by_kind,
            "examples": {
                "missing": self.missing[:EXAMPLES],
                "wrong": self.wrong[:EXAMPLES],
                "duplicated": self.duplicated_tasks[:EXAMPLES],
                "unexplained_dead_letters": self.unexplained_letters[:EXAMPLES],
            },
        }


def answer_figures(
    expected: Mapping[str, Expected],
    messages: Iterable[tuple[str | None, bytes, bool]],
    letters: Iterable[DeadLetter],
) -> AnswerFigures:
    """Compare every result message (task id, body, redelivered) and every dead letter that is
    not a hostile message's with what each task must get (``expected``).

    A task expecting a result must have one or more result messages, all the same answer (the
    same body for an ``ok``; the same error type for an error) and that answer; none of its
    messages may be dead-lettered unless its kind explains it. A ``full-never`` task must have
    no result and a dead letter ``refused`` holding its ``ok`` result."""
    bodies, redelivered_duplicates, unexpected, total = results_by_task(expected, messages)
    kept: dict[str, list[DeadLetter]] = {}
    unexplained: list[str] = []
    count = 0
    for letter in letters:
        count += 1
        task_id = letter_task_id(letter, expected)
        if task_id is None or letter.reason not in expected[task_id].may_letter:
            unexplained.append(
                f"{task_id or letter.message_id}: {letter.reason} ({letter.detail[:120]})"
            )
            continue
        kept.setdefault(task_id, []).append(letter)
    missing, wrong = [], []
    by_kind: dict[str, Counter[str]] = {}
    by_result = by_letter = 0
    for task_id, want in expected.items():
        tally = by_kind.setdefault(want.kind, Counter())
        tally["tasks"] += 1
        received = bodies.get(task_id, [])
        if want.letter is not None:
            answers = [
                letter
                for letter in kept.get(task_id, [])
                if letter.reason == want.letter and _matches(want, decoded(letter.body))
            ]
            if received or (kept.get(task_id) and not answers):
                wrong.append(task_id)
            elif not answers:
                missing.append(task_id)
            else:
                by_letter += 1
                tally["answered"] += 1
                tally["by_dead_letter"] += 1
            continue
        if not received:
            missing.append(task_id)
            continue
        if want.error_type is None:
            same = len({canonical_or_raw(body) for body in received}) == 1
        else:
            same = True  # (compared by type below)
        if not same or not all(_matches(want, decoded(body)) for body in received):
            wrong.append(task_id)
            continue
        by_result += 1
        tally["answered"] += 1
        tally["by_result"] += 1
    duplicated = [t for t, received in bodies.items() if len(received) > 1]
    return AnswerFigures(
        messages=total,
        answered=by_result + by_letter,
        by_result=by_result,
        by_letter=by_letter,
        missing=missing,
        wrong=wrong,
        duplicates=sum(len(bodies[t]) - 1 for t in duplicated),
        duplicates_redelivered=redelivered_duplicates,
        duplicated_tasks=duplicated,
        unexpected=unexpected,
        letters=count,
        unexplained_letters=unexplained,
        by_kind={kind: dict(tally) for kind, tally in by_kind.items()},
    )
