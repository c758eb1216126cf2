"""Forms from JSON Schemas (``waystation.console.forms``): the inputs the console shows for a
typed signal, and the payload it makes of what a person posts, which the agent's own model
must read back as what was meant."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from waystation.console.app import templates
from waystation.console.forms import (
    PAYLOAD,
    FormProblem,
    fields,
    form_values,
    payload,
    signal_id_of,
)


class Address(BaseModel):
    city: str
    zip: str = ""


class Colour(StrEnum):
    red = "red"
    green = "green"


class Expense(BaseModel):
    """A manager's answer to an expense claim."""

    decision: Literal["approve", "reject"] = Field(description="approve pays the claim")
    amount: int = Field(ge=0, description="what to pay, in euros")
    ratio: float = 0.5
    urgent: bool = False
    note: str = ""
    reviewer: str | None = None
    pay_on: datetime
    address: Address
    tags: list[str] = []
    colour: Colour = Colour.red


SCHEMA = Expense.model_json_schema()


def by_name(schema: Any) -> dict[str, Any]:
    return {field.name: field for field in fields(schema)}


def test_each_property_of_a_model_becomes_the_input_its_type_asks_for() -> None:
    found = by_name(SCHEMA)
    assert list(found) == list(Expense.model_fields)
    kinds = {name: field.kind for name, field in found.items()}
    assert kinds == {
        "decision": "select",
        "amount": "number",
        "ratio": "number",
        "urgent": "checkbox",
        "note": "text",
        "reviewer": "json",  # anyOf (an Optional)
        "pay_on": "datetime",
        "address": "json",  # a nested model ($ref)
        "tags": "json",  # a list
        "colour": "select",  # a $ref to a plain enum
    }
    assert found["decision"].options == ("approve", "reject")
    assert found["decision"].description == "approve pays the claim"
    assert found["decision"].required and found["amount"].required
    assert not found["ratio"].required and found["ratio"].default == 0.5
    assert found["amount"].integer and not found["ratio"].integer
    assert found["colour"].options == ("red", "green")
    assert found["colour"].title == "colour", "an enum's class name is not the field's title"
    assert found["address"].title == "address"  # a $ref has no title: its name
    assert found["amount"].title == "Amount"
    assert found["pay_on"].hint is not None and "ISO 8601" in found["pay_on"].hint
    assert found["amount"].input_name == "field.amount"


def test_a_signal_without_a_schema_or_with_no_properties_is_asked_for_as_json() -> None:
    for schema in (None, {"type": "string"}, "not a schema", {"properties": "x"}):
        [whole] = fields(schema)
        assert (whole.kind, whole.input_name) == ("json", PAYLOAD)
        assert payload(schema, {PAYLOAD: '{"ok": [1, 2]}'}) == {"ok": [1, 2]}
        assert payload(schema, {PAYLOAD: "  "}) is None, "blank: no payload"
        with pytest.raises(FormProblem, match=r"^payload: not JSON"):
            payload(schema, {PAYLOAD: "{oops"})
    assert fields({"type": "object", "properties": {}}) == []
    assert payload({"type": "object", "properties": {}}, {}) == {}


def test_a_posted_form_becomes_the_payload_the_model_reads() -> None:
    posted = {
        "field.decision": "approve",
        "field.amount": "120",
        "field.ratio": "0.25",
        "field.urgent": "true",
        "field.note": "ok <b>",
        "field.reviewer": '"ann"',
        "field.pay_on": "2026-12-01T09:30:00Z",
        "field.address": '{"city": "Lyon"}',
        "field.tags": '["travel"]',
        "field.colour": "green",
    }
    made = payload(SCHEMA, posted)
    assert made["amount"] == 120 and made["ratio"] == 0.25 and made["urgent"] is True
    assert Expense.model_validate(made) == Expense(
        decision="approve",
        amount=120,
        ratio=0.25,
        urgent=True,
        note="ok <b>",
        reviewer="ann",
        pay_on=datetime(2026, 12, 1, 9, 30, tzinfo=UTC),
        address=Address(city="Lyon"),
        tags=["travel"],
        colour=Colour.green,
    )


def test_blank_optional_fields_are_left_out_so_that_their_defaults_apply() -> None:
    posted = {
        "field.decision": "reject",
        "field.amount": "0",
        "field.ratio": "",
        "field.reviewer": " ",
        "field.pay_on": "2026-12-01",
        "field.address": '{"city": "Lyon"}',
        "field.tags": "",
        "field.colour": "",
    }
    made = payload(SCHEMA, posted)
    assert made == {
        "decision": "reject",
        "amount": 0,
        "urgent": False,  # an unticked checkbox posts nothing: false
        "pay_on": "2026-12-01",
        "address": {"city": "Lyon"},
    }
    assert Expense.model_validate(made).ratio == 0.5
    spaces = payload(SCHEMA, {**posted, "field.note": "  "})
    assert spaces["note"] == "  ", "a text's spaces are its value, not a blank"


def test_what_cannot_be_converted_is_refused_naming_each_field() -> None:
    posted = {
        "field.decision": "maybe",
        "field.amount": "a lot",
        "field.ratio": "nan",
        "field.pay_on": "next tuesday",
        "field.address": "{city: Lyon}",
        "field.tags": "",
        "field.colour": "red",
    }
    with pytest.raises(FormProblem) as refused:
        payload(SCHEMA, posted)
    problems = refused.value.problems
    assert [problem.split(":")[0] for problem in problems] == [
        "decision",
        "amount",
        "ratio",
        "pay_on",
        "address",
    ]
    assert problems[0] == "decision: 'maybe' is not one of approve, reject"
    assert problems[1] == "amount: 'a lot' is not a whole number"
    assert problems[2] == "ratio: 'nan' is not a finite number"
    assert "amount: 'a lot' is not a whole number" in str(refused.value)
    with pytest.raises(FormProblem, match=r"^amount: '1.5' is not a whole number$"):
        payload(SCHEMA, _fixed())
    with pytest.raises(FormProblem, match=r"^amount: is required$"):
        payload(SCHEMA, {**_fixed(), "field.amount": " "})
    with pytest.raises(FormProblem, match=r"^amount: '1(0){20}' is out of range"):
        payload(SCHEMA, {**_fixed(), "field.amount": "1" + "0" * 20})


def _fixed() -> dict[str, str]:
    """A form whose every other field converts."""
    return {
        "field.decision": "approve",
        "field.amount": "1.5",
        "field.pay_on": "2026-12-01T09:30:00+01:00",
        "field.address": "{}",
        "field.colour": "red",
    }


def test_a_field_shows_its_default_then_what_was_posted() -> None:
    found = by_name(SCHEMA)
    assert found["ratio"].shown({}) == "0.5"
    assert found["note"].shown({}) == ""
    assert found["tags"].shown({}) == "[]"
    assert found["colour"].shown({}) == "red"
    assert found["reviewer"].shown({}) == "", "a None default is a blank field"
    assert found["amount"].shown({}) == ""
    posted = {"wait": "approval", "field.amount": "a lot"}
    assert found["amount"].shown(posted) == "a lot"
    assert found["ratio"].shown(posted) == "", "posted blank: shown blank, not its default"
    ticked = by_name({"properties": {"go": {"type": "boolean", "default": True}}})["go"]
    assert ticked.checked({}) and not ticked.checked({"wait": "approval"})


text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["", " ", "\t", "0", "true", "null", "[]"]
)
expenses = st.builds(
    Expense,
    decision=st.sampled_from(["approve", "reject"]),
    amount=st.integers(min_value=0, max_value=2**63 - 1),
    ratio=st.floats(allow_nan=False, allow_infinity=False),
    urgent=st.booleans(),
    note=text,
    reviewer=st.none() | text,
    pay_on=st.datetimes(timezones=st.just(UTC)),
    address=st.builds(Address, city=text, zip=text),
    tags=st.lists(text, max_size=3),
    colour=st.sampled_from(Colour),
)


@given(expenses)
def test_any_payload_round_trips_through_its_form(expense: Expense) -> None:
    as_json = expense.model_dump(mode="json")
    posted = form_values(fields(SCHEMA), as_json)
    assert all(isinstance(value, str) for value in posted.values())
    assert Expense.model_validate(payload(SCHEMA, posted)) == expense


@given(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | text | st.lists(text))
def test_any_untyped_payload_round_trips_through_its_textarea(value: Any) -> None:
    assert payload(None, form_values(fields(None), value)) == value


@given(
    st.dictionaries(
        text,
        st.recursive(
            st.none() | st.booleans() | st.integers() | text,
            lambda inner: st.lists(inner) | st.dictionaries(text, inner),
            max_leaves=6,
        ),
        max_size=6,
    )
)
def test_any_schema_makes_fields_and_a_blank_form_never_crashes(schema: dict[str, Any]) -> None:
    for shape in (schema, {"properties": schema}, {"properties": schema, "required": list(schema)}):
        made = fields(shape)
        for field in made:
            field.shown({})
        try:
            payload(shape, {})
        except FormProblem as problem:
            assert problem.problems


def test_a_forms_signal_id_is_the_same_for_one_rendering_and_short_whatever_is_posted() -> None:
    first = signal_id_of("task-1", "approval", "nonce-a")
    assert first == signal_id_of("task-1", "approval", "nonce-a")
    assert len({first, signal_id_of("task-1", "approval", "nonce-b")}) == 2
    assert first != signal_id_of("task-2", "approval", "nonce-a")
    assert first != signal_id_of("task-1", "other", "nonce-a")
    hostile = signal_id_of("t", "approval", "<x>" * 10_000)
    assert re.fullmatch(r"console:[0-9a-f]{32}", hostile)


def render_form(**context: Any) -> str:
    page = templates().get_template("_signal_form.html")
    defaults: dict[str, Any] = {
        "task_id": "task/1?x",
        "wait": {"name": "approval", "signal_schema": SCHEMA, "subtask_id": "w", "deadline_at": 0},
        "csrf": "token",
        "can_act": True,
        "read_only": False,
        "values": {},
        "problem": None,
        "request_path": "/approvals",
    }
    return page.render(**{**defaults, **context})


def test_the_form_posts_every_field_to_the_tasks_signal_route_with_its_nonce() -> None:
    html = render_form()
    assert 'class="signal-form' in html and 'data-signal="approval"' in html
    assert 'action="/tasks/task%2F1%3Fx/signal"' in html
    assert '<input type="hidden" name="csrf" value="token">' in html
    assert '<input type="hidden" name="wait" value="approval">' in html
    for name in Expense.model_fields:
        assert f'name="field.{name}"' in html
    assert '<option value="reject">reject</option>' in html
    assert '<option value="red" selected>red</option>' in html
    assert 'type="checkbox" name="field.urgent" value="true">' in html
    assert ">Send approval</button>" in html
    nonces = set(re.findall(r'name="nonce" value="([^"]+)"', render_form() + render_form()))
    assert len(nonces) == 2, "each rendering has a nonce of its own"


def test_the_form_shows_the_problem_and_the_values_and_escapes_them() -> None:
    hostile = '"><script>alert(1)</script>'
    schema = {
        "title": hostile,
        "properties": {"amount": {"type": "integer", "title": hostile, "description": hostile}},
    }
    html = render_form(
        wait={"name": hostile, "signal_schema": schema, "subtask_id": "w", "deadline_at": 0},
        values={"wait": hostile, "field.amount": hostile},
        problem=f"amount: {hostile}",
    )
    assert "<script>" not in html
    assert html.count("&lt;script&gt;") >= 5  # the name, the title, the value, the problem...
    assert 'class="problem" role="alert"' in html


def test_without_a_session_the_form_is_a_note_instead() -> None:
    signed_out = render_form(can_act=False)
    assert "<form" not in signed_out and "/sign-in?next=/approvals" in signed_out
    read_only = render_form(can_act=False, read_only=True)
    assert "<form" not in read_only and "read-only" in read_only
