"""The console's sessions and CSRF tokens: only the console's token makes them, and nothing a
client changes in them passes."""

from __future__ import annotations

import pytest

from waystation.console.security import SESSION_SECONDS, Signer, clean_name


def test_a_session_round_trips_and_names_its_actor() -> None:
    signer = Signer("s3cret")
    issued, cookie = signer.issue("Alice Approver", now=1000)
    found = signer.session(cookie, now=1001)
    assert found == issued
    assert found.actor == "console:Alice Approver"


def test_a_session_signed_with_another_token_or_altered_is_refused() -> None:
    _, cookie = Signer("s3cret").issue("alice", now=1000)
    assert Signer("other").session(cookie, now=1001) is None
    version, session_id, name, issued, mac = cookie.split(".")
    forged_name = "Ym9i"  # "bob"
    assert (
        Signer("s3cret").session(".".join((version, session_id, forged_name, issued, mac))) is None
    )
    later = str(int(issued) + 10)
    assert Signer("s3cret").session(".".join((version, session_id, name, later, mac))) is None
    assert Signer("s3cret").session("garbage") is None
    assert Signer("s3cret").session("") is None


def test_a_session_expires() -> None:
    signer = Signer("s3cret")
    _, cookie = signer.issue("alice", now=1000)
    assert signer.session(cookie, now=1000 + SESSION_SECONDS - 1) is not None
    assert signer.session(cookie, now=1000 + SESSION_SECONDS) is None


def test_the_csrf_token_is_bound_to_the_session() -> None:
    signer = Signer("s3cret")
    alice, _ = signer.issue("alice")
    bob, _ = signer.issue("bob")
    assert signer.csrf_ok(alice, signer.csrf(alice))
    assert not signer.csrf_ok(alice, signer.csrf(bob))
    assert not signer.csrf_ok(alice, None)
    assert not signer.csrf_ok(alice, "")


def test_the_token_is_checked_whole() -> None:
    signer = Signer("s3cret")
    assert signer.accepts("s3cret")
    assert not signer.accepts("s3cre")
    assert not signer.accepts("")
    with pytest.raises(ValueError):
        Signer("")


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("alice", "alice"),
        ("<script>alert(1)</script>", "scriptalert1script"),
        ("a\nb\x00c", "abc"),
        ("   ", "anonymous"),
        ("x" * 100, "x" * 64),
    ],
)
def test_a_name_keeps_only_plain_characters(given: str, kept: str) -> None:
    assert clean_name(given) == kept
