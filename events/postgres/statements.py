"""The SQL of the log on PostgreSQL (:mod:`.store` runs it).

The append is one statement: the events (all of one decision, through ``unnest``) and the outbox
rows they imply go in together, in data-modifying CTEs that commit together or not at all. The
hot path's statements also come in asyncpg's form (``$n`` parameters), for the store's own
connections; the same SQL, so the same plan and types.
"""

from __future__ import annotations

import re

from sqlalchemy import text

from .horizon import SNAPSHOT_HORIZON

_APPEND = text(
    """
    WITH head_ok AS (
        SELECT 1 WHERE (CAST(:expected AS integer) = 0 AND CAST(:prev_hash AS bytea) = :genesis)
            OR EXISTS (
                SELECT 1 FROM events
                WHERE stream_id = :stream AND stream_version = :expected AND hash = :prev_hash)
    ), appended AS (
        INSERT INTO events (stream_id, stream_version, event_id, event_type, schema_version,
                            data, metadata, prev_hash, hash)
        SELECT :stream, v, e, t, s, CAST(d AS jsonb), CAST(m AS jsonb), p, h
        FROM unnest(CAST(:versions AS integer[]), CAST(:event_ids AS uuid[]),
                    CAST(:types AS text[]), CAST(:schema_versions AS integer[]),
                    CAST(:data AS text[]), CAST(:metadata AS text[]),
                    CAST(:prev_hashes AS bytea[]), CAST(:hashes AS bytea[]))
             AS u(v, e, t, s, d, m, p, h)
        WHERE EXISTS (SELECT 1 FROM head_ok)
        RETURNING global_position, metadata->>'deployment' AS deployment
    ), published AS (
        INSERT INTO outbox (message_id, stream_id, exchange, routing_key, properties, body,
                            available_at, deployment)
        SELECT mi, :stream, ex, rk, CAST(pr AS jsonb), bd,
               now() + make_interval(secs => greatest(CAST(:outbox_delay AS double precision), dl)),
               (SELECT deployment FROM appended ORDER BY global_position LIMIT 1)
        FROM unnest(CAST(:message_ids AS text[]), CAST(:exchanges AS text[]),
                    CAST(:routing_keys AS text[]), CAST(:properties AS text[]),
                    CAST(:bodies AS bytea[]), CAST(:delays AS double precision[]))
             AS o(mi, ex, rk, pr, bd, dl)
        WHERE EXISTS (SELECT 1 FROM appended)
        RETURNING id
    )
    SELECT (SELECT count(*) FROM appended) AS appended,
           ARRAY(SELECT id FROM published ORDER BY id) AS outbox_ids,
           CASE WHEN NOT EXISTS (SELECT 1 FROM head_ok)
                THEN (SELECT max(stream_version) FROM events WHERE stream_id = :stream)
           END AS head
    """
)


def _positional(statement: str) -> tuple[str, list[str]]:
    """``statement`` with SQLAlchemy's ``:name`` parameters as asyncpg's ``$n``, and the names
    in their order (a name used twice is one parameter)."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return re.sub(r"(?<![:\w]):([a-z_]+)\b", number, statement), names


_APPEND_ASYNCPG, _APPEND_PARAMS = _positional(_APPEND.text)
"""The append as the hot path runs it: straight on asyncpg (see :class:`.store.PostgresEventStore`),
which spares SQLAlchemy's execution layer and its pool (measured: ~0.1 ms of CPU per statement
against asyncpg's ~0.04 ms; the design allows it on the hot path, docs/performance.md). The
same SQL, so the same plan and types."""

_FIND_EVENTS = """
    SELECT event_id, stream_id, stream_version, hash FROM events
    WHERE event_id = ANY($1::uuid[]) ORDER BY stream_version
"""

_COLUMNS = """stream_id, stream_version, event_id, event_type, data::text, metadata::text,
              schema_version, prev_hash, hash, global_position, tx_id::text, recorded_at"""

_READ_STREAM = text(
    f"""SELECT {_COLUMNS} FROM events WHERE stream_id = :stream AND stream_version > :after
        ORDER BY stream_version"""
)

_LAST_EVENT = text(
    f"""SELECT {_COLUMNS} FROM events WHERE stream_id = :stream
        ORDER BY stream_version DESC LIMIT 1"""
)

_READ_STREAM_ASYNCPG = _positional(_READ_STREAM.text)[0]
_LAST_EVENT_ASYNCPG = _positional(_LAST_EVENT.text)[0]

_READ_ALL = text(
    f"""
    SELECT {_COLUMNS} FROM events
    WHERE (tx_id, global_position) > (CAST(CAST(:tx_id AS text) AS xid8), CAST(:position AS bigint))
      AND tx_id < {SNAPSHOT_HORIZON}
    ORDER BY events.tx_id, events.global_position  -- the column: "tx_id" alone is the text
    LIMIT :limit
    """
)

_CLAIM_OUTBOX = text(
    """
    UPDATE outbox SET available_at = now() + make_interval(secs => CAST(:lease AS double precision))
    WHERE id IN (SELECT id FROM outbox
                 WHERE available_at <= now()
                   AND (CAST(:deployment AS text) IS NULL OR deployment IS NULL
                        OR deployment = :deployment)
                 ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED)
    RETURNING id, message_id, exchange, routing_key, properties::text, body, refusals,
              extract(epoch FROM now() - created_at)::float8
    """
)

_RETRY_OUTBOX = text(
    """
    UPDATE outbox
    SET available_at = now() + make_interval(secs => CAST(:delay AS double precision)),
        refusals = refusals + CASE WHEN CAST(:refused AS text) IS NULL THEN 0 ELSE 1 END,
        last_refusal = coalesce(CAST(:refused AS text), last_refusal)
    WHERE id = ANY(CAST(:ids AS bigint[]))
    """
)

_CLAIM_EXPIRED = text(
    """
    UPDATE pending_calls
    SET leased_until = now() + make_interval(secs => CAST(:lease AS double precision))
    WHERE subtask_id IN (
        SELECT subtask_id FROM pending_calls
        WHERE deadline_at <= now() AND (leased_until IS NULL OR leased_until <= now())
          AND (CAST(:deployment AS text) IS NULL OR deployment = :deployment)
        ORDER BY deadline_at LIMIT :limit FOR UPDATE SKIP LOCKED)
    RETURNING subtask_id, task_id, agent, extract(epoch FROM now())::float8, kind
    """
)

_PENDING_OF_TASK = text(
    "SELECT subtask_id, extract(epoch FROM deadline_at) FROM pending_calls WHERE task_id = :task"
)

_DELETE_OUTBOX = "DELETE FROM outbox WHERE id = ANY($1::bigint[])"
_REPLACE_OUTBOX = text(
    """
    UPDATE outbox
    SET message_id = :message_id, exchange = :exchange, routing_key = :routing_key,
        properties = CAST(:properties AS jsonb), body = :body
    WHERE id = :id
    """
)
_OUTBOX_SIZE = text(
    """
    SELECT count(*) FROM outbox
    WHERE CAST(:deployment AS text) IS NULL OR deployment IS NULL OR deployment = :deployment
    """
)
_OUTBOX_OLDEST = text(
    """
    SELECT extract(epoch FROM now() - min(created_at))::float8 FROM outbox
    WHERE CAST(:deployment AS text) IS NULL OR deployment IS NULL OR deployment = :deployment
    """
)
