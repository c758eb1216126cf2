"""``waystation dead-letters``: inspect the dead-letter queue, and replay it, recorded in the log.

A replay is an operator's act on the deployment: it is recorded in the operations stream
(``DeadLettersReplayed``, ``waystation.events.operations``) with who replayed (``--actor``, by
default ``cli:`` and the OS user's name). Recording comes after the republish: if it fails, the
letters are back in their queues all the same, and the command says so and exits non-zero.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from waystation.cli.exits import EXIT_STORE
from waystation.cli.wiring import actor_option, load_settings, open_store, run
from waystation.events.codec import dumps

if TYPE_CHECKING:
    from waystation.brokers.amqp.deadletters import DeadLetter
    from waystation.settings import Settings

__all__ = ["dead_letters"]


@click.group(name="dead-letters")
def dead_letters() -> None:
    """Inspect and replay the dead-letter queue (see docs/failures.md)."""


@dead_letters.command(name="list")
@click.option("--limit", type=int, default=50, show_default=True, help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def list_dead_letters(limit: int, as_json: bool) -> None:
    """Show dead letters with their reasons; they stay in the queue."""
    from waystation.brokers.amqp.deadletters import browse
    from waystation.protocol.wire import Names

    settings = load_settings()
    letters = run(browse(settings.amqp_url, Names(settings.queue_prefix), limit))
    _print_letters(letters, as_json)


@dead_letters.command(name="replay")
@click.option("--reason", help="Only dead letters of this reason (e.g. handler-failed).")
@click.option("--message-id", help="Only the dead letter with this message id (see `list`).")
@click.option(
    "--limit",
    type=int,
    default=50,
    show_default=True,
    help="Look at this many letters of the queue, at most.",
)
@actor_option("replays")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
def replay_dead_letters(
    reason: str | None, message_id: str | None, limit: int, actor: str, as_json: bool
) -> None:
    """Send dead letters back to the queue they came from (after fixing the cause), and record
    the replay in the log (a DeadLettersReplayed event in the waystation-operations stream).

    Exit codes: 0 replayed and recorded (or nothing to replay), 4 replayed but not recorded
    (the log could not be written: the letters are back in their queues all the same).
    """
    settings = load_settings()
    sys.exit(run(_replay(settings, reason, message_id, limit, actor, as_json)))


async def _replay(
    settings: Settings,
    reason: str | None,
    message_id: str | None,
    limit: int,
    actor: str,
    as_json: bool,
) -> int:
    from waystation.brokers.amqp.deadletters import ReplayNotRecorded, replay
    from waystation.protocol.wire import Names

    store = open_store(settings)
    try:
        letters = await replay(
            settings.amqp_url,
            Names(settings.queue_prefix),
            reason=reason,
            message_id=message_id,
            limit=limit,
            store=store,
            actor=actor,
        )
    except ReplayNotRecorded as error:
        _print_letters(error.replayed, as_json)
        click.echo(
            f"replayed {len(error.replayed)} message(s), but NOT recorded in the event log: "
            f"{error.cause!r}",
            err=True,
        )
        return EXIT_STORE
    finally:
        await store.close()
    _print_letters(letters, as_json)
    if not as_json:
        click.echo(f"replayed {len(letters)} message(s)")
    return 0


def _print_letters(letters: list[DeadLetter], as_json: bool) -> None:
    if as_json:
        click.echo(dumps([letter.to_json() for letter in letters]).decode())
        return
    if not letters:
        click.echo("no dead letters")
        return
    click.echo(f"{'reason':<26} {'from queue':<36} {'message id':<40} detail")
    for letter in letters:
        click.echo(
            f"{letter.reason:<26} {letter.queue or '?':<36} {letter.message_id or '-':<40} "
            f"{letter.detail[:80]}"
        )
