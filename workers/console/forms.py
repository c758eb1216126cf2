"""Forms from JSON Schemas: what the console asks a person for to answer a typed signal.

A typed signal's wait records the JSON Schema of its payload (the agent's declared pydantic
model, ``model_json_schema()``), so the console can ask for it field by field without the
agent's code. :func:`fields` turns an object schema's properties into inputs: a string is a
text input (a select when it has an ``enum`` or ``const``, a Literal; a hint when its format is
a date and time), an integer or number a number input, a boolean a checkbox. Anything a single
input cannot hold (a nested model, a list, ``anyOf`` such as an Optional, a ``$ref`` other than
to a plain enum) is a JSON textarea of its own. A signal without a schema, or whose schema is
not an object's, is asked for as one JSON textarea, ``payload``.

:func:`payload` converts the posted strings back: a blank optional field is left out (its
default applies), a number or JSON that is not one is a :class:`FormProblem` naming the field.
That is all the console checks. Whether the payload fits the model is the worker's decision (it
validates every signal against the agent's declared model, whichever worker takes it), and its
refusal names the field too; the console shows that answer rather than check twice with rules
of its own that could differ.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date, datetime, time
from typing import Any, Literal

import orjson

__all__ = [
    "PAYLOAD",
    "TEMPLATE_GLOBALS",
    "Field",
    "FormProblem",
    "fields",
    "form_values",
    "new_nonce",
    "payload",
    "signal_id_of",
]

PAYLOAD = "payload"
"""The input of a signal asked for whole, as JSON."""

Kind = Literal["text", "select", "number", "checkbox", "datetime", "json"]

_FORMATS: dict[str, tuple[str, Any]] = {
    "date-time": ("a date and time, ISO 8601: 2026-11-28T09:30:00Z", datetime.fromisoformat),
    "date": ("a date, ISO 8601: 2026-11-28", date.fromisoformat),
    "time": ("a time, ISO 8601: 09:30:00", time.fromisoformat),
}
"""String formats asked for with a hint, and the check of a posted one."""
_TRUE = frozenset({"true", "on", "yes", "1"})


class FormProblem(ValueError):
    """What is wrong with a posted form, one ``field: why`` per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class Field:
    """One input of a signal's form."""

    name: str
    """The property (``""`` for the whole payload of an untyped signal)."""
    kind: Kind
    title: str
    description: str | None = None
    required: bool = False
    default: Any = None
    has_default: bool = False
    options: tuple[Any, ...] = ()
    """A select's values, as JSON."""
    integer: bool = False
    format: str | None = None
    """A string's format (``date-time``, ``date``, ``time``) when it has a hint."""

    @property
    def hint(self) -> str | None:
        return _FORMATS[self.format][0] if self.format in _FORMATS else None

    @property
    def input_name(self) -> str:
        """The name of its input: ``field.<property>``, or ``payload`` for a whole payload."""
        return f"field.{self.name}" if self.name else PAYLOAD

    @property
    def option_texts(self) -> list[str]:
        return [_text(option) for option in self.options]

    def shown(self, values: Mapping[str, str]) -> str:
        """What its input shows: the value posted before (``values``, the form as posted when
        it is shown again with a problem: never empty, it names the wait), else its default."""
        if values:
            return str(values.get(self.input_name, ""))
        if not self.has_default:
            return ""
        return form_values([self], {self.name: self.default}).get(self.input_name, "")

    def checked(self, values: Mapping[str, str]) -> bool:
        """Whether its checkbox is ticked."""
        return self.shown(values).lower() in _TRUE


def _text(value: Any) -> str:
    """A JSON value as a form shows it: a string as itself, anything else as JSON."""
    return value if isinstance(value, str) else _dumps(value)


def _dumps(value: Any) -> str:
    """``value`` as JSON, as the standard library writes it: any integer (a schema's default or
    enum from the log is not bound to orjson's 64 bits), every character as itself."""
    return json.dumps(value, ensure_ascii=False)


def _resolve(schema: Mapping[str, Any], prop: Mapping[str, Any]) -> Mapping[str, Any]:
    """``prop`` with a local ``$ref`` to a plain enum (a Python ``Enum``) replaced by that
    enum, so that it is a select; any other ``$ref`` stays one (a JSON textarea)."""
    ref = prop.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/$defs/"):
        return prop
    definitions = schema.get("$defs")
    target = (
        definitions.get(ref.removeprefix("#/$defs/")) if isinstance(definitions, dict) else None
    )
    if not isinstance(target, dict) or not isinstance(target.get("enum"), list):
        return prop
    merged = {**target, **{k: v for k, v in prop.items() if k != "$ref"}}
    if "title" not in prop:
        merged.pop("title", None)  # the enum's class name is not the field's title
    return merged


def _kind(prop: Mapping[str, Any]) -> tuple[Kind, tuple[Any, ...]]:
    if isinstance(prop.get("enum"), list) and prop["enum"]:
        return "select", tuple(prop["enum"])
    if "const" in prop:
        return "select", (prop["const"],)
    kind = prop.get("type")
    if any(key in prop for key in ("$ref", "anyOf", "oneOf", "allOf")) or not isinstance(kind, str):
        return "json", ()
    if kind == "string":
        return ("datetime" if prop.get("format") in _FORMATS else "text"), ()
    if kind in ("integer", "number"):
        return "number", ()
    if kind == "boolean":
        return "checkbox", ()
    return "json", ()  # object, array, null


def fields(schema: Any) -> list[Field]:
    """The inputs asking for a payload that fits ``schema``: one per property of an object
    schema, in its order; one JSON textarea (``payload``) for no schema or any other."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return [Field(name="", kind="json", title="Payload (JSON)")]
    listed = schema.get("required")
    required = set(listed) if isinstance(listed, list) else set()
    found = []
    for name, raw in properties.items():
        prop = _resolve(schema, raw) if isinstance(raw, dict) else {}
        kind, options = _kind(prop)
        description = prop.get("description")
        title = prop.get("title")
        found.append(
            Field(
                name=str(name),
                kind=kind,
                title=str(title) if isinstance(title, str) and title else str(name),
                description=str(description) if isinstance(description, str) else None,
                required=name in required,
                default=prop.get("default"),
                has_default="default" in prop,
                options=options,
                integer=prop.get("type") == "integer",
                format=str(prop["format"]) if kind == "datetime" else None,
            )
        )
    return found


def form_values(form_fields: list[Field], value: Mapping[str, Any] | Any) -> dict[str, str]:
    """The posted strings that stand for ``value`` (what :func:`payload` turns back into it):
    a form's defaults, and what the tests round-trip. An unticked checkbox posts nothing."""
    posted: dict[str, str] = {}
    for field in form_fields:
        if not field.name:
            posted[PAYLOAD] = "" if value is None else _dumps(value)
            continue
        if not isinstance(value, Mapping) or field.name not in value:
            continue
        item = value[field.name]
        if field.kind == "checkbox":
            if item is True:
                posted[field.input_name] = "true"
        elif field.kind == "json":
            if item is not None or field.required or field.default is not None:
                posted[field.input_name] = _dumps(item)
        elif field.kind == "number" and isinstance(item, int | float):
            posted[field.input_name] = repr(item)
        elif item is not None:
            posted[field.input_name] = _text(item)
    return posted


def payload(schema: Any, form: Mapping[str, Any]) -> Any:
    """The payload the posted ``form`` stands for (see :func:`fields`); raises
    :class:`FormProblem` naming each field that cannot be converted."""
    converted: dict[str, Any] = {}
    problems: list[str] = []
    for field in fields(schema):
        raw = form.get(field.input_name)
        text = raw if isinstance(raw, str) else ""
        # blank: nothing typed (for a text, spaces are its value)
        blank = text == "" if field.kind == "text" else not text.strip()
        try:
            if not field.name:
                return None if blank else _json(text)
            if field.kind == "checkbox":
                converted[field.name] = text.lower() in _TRUE
            elif blank and not (field.kind == "text" and field.required):
                if field.required:
                    raise ValueError("is required")
                # blank and optional: left out, so that its default applies
            else:
                converted[field.name] = _converted(field, text)
        except ValueError as problem:
            problems.append(f"{field.name or PAYLOAD}: {problem}")
    if problems:
        raise FormProblem(problems)
    return converted


def _converted(field: Field, text: str) -> Any:
    if field.kind == "number":
        return _number(text.strip(), field.integer)
    if field.kind == "select":
        texts = field.option_texts
        if text not in texts:
            raise ValueError(f"{text!r} is not one of {', '.join(texts)}")
        return field.options[texts.index(text)]
    if field.kind == "datetime":
        try:
            _FORMATS[str(field.format)][1](text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not {field.hint}") from None
        return text.strip()
    if field.kind == "json":
        return _json(text)
    return text


def _number(text: str, integer: bool) -> int | float:
    try:
        whole = int(text)
    except ValueError:
        pass
    else:
        if not -(2**63) <= whole < 2**64:  # what JSON carries here (orjson's integers)
            raise ValueError(f"{text!r} is out of range (at most 64 bits)")
        return whole
    if integer:
        raise ValueError(f"{text!r} is not a whole number")
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not a finite number")
    return number


def _json(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error})") from None


def new_nonce() -> str:
    """A fresh value for a form's hidden ``nonce``: each rendering of a signal's form has its
    own, and the signal it sends an id derived from it (:func:`signal_id_of`)."""
    return secrets.token_urlsafe(16)


def signal_id_of(task_id: str, name: str, nonce: str) -> str:
    """The id of the signal a form sends: the same for every submission of one rendering of
    the form (a double click, a resent POST), so the worker answers the second ``duplicate``
    rather than apply it twice; another for the next rendering. Hashed, so whatever a form
    posts as its nonce, the id is short and plain."""
    digest = hashlib.sha256("\0".join((task_id, name, nonce)).encode()).hexdigest()
    return f"console:{digest[:32]}"


TEMPLATE_GLOBALS: dict[str, Any] = {"signal_fields": fields, "form_nonce": new_nonce}
"""What the signal form's template calls (the console adds them to its templates)."""
