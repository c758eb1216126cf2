"""A worker process under hostile messages, and what must hold after each (G9).

:class:`Target` is one worker process of ``tests.apps.fuzz_target`` (the agent ``echo``) on a
deployment of its own, watched three ways: its log (its broker connection dropped, or a
delivery's handling raised out of the worker, which leaves the delivery unsettled for good),
RabbitMQ (``rabbitmqctl``: its connection, and the deliveries it holds unsettled), and a normal
task it must answer.

:class:`Campaign` sends each message with the raw client (:mod:`.amqp`) to ``<prefix>echo``
and checks, in this order:

1. the broker's verdict; a message it refused (a closed channel or connection) has no fate to
   look for, and is recorded with the broker's code and text;
2. the message's fate: its handler ran (``$FUZZ_RUNS``), as often as its body asks; or it is in
   ``<prefix>dead-letter`` (found by the fuzz id in its body) with an ``x-waystation-reason``
   header (any reason: the set a worker uses may grow);
3. the worker answers a normal task (with a ``reply_to``) within a few seconds;
4. the worker is still on the broker connection it started with and holds nothing unsettled;
5. its log says nothing of a dropped connection or a delivery left unsettled.

Every wait is for a condition, with a generous limit. After a failure the campaign puts a new
worker on fresh queues (a poison message would otherwise fail every check after it), unless
told to stop at the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waystation.client import Client
from waystation.protocol.wire import HEADER_REASON, Names
from waystation.settings import Settings

from ..harness.broker import delete_topology, queue_depth, run_rabbitmqctl, wait_for_consumers
from ..harness.processes import WorkerProcess
from .amqp import Letter, RawClient, Verdict
from .messages import Draft, Message

__all__ = [
    "AGENT",
    "APP",
    "Campaign",
    "LogRecord",
    "Outcome",
    "Target",
    "as_json",
    "report_failures",
    "summary",
]

APP = "tests.apps.fuzz_target:app"
AGENT = "echo"

DROPPED = (
    "reader exited abnormally",
    "Connection attempt to",
    "Unexpected connection close",
)
"""What aiormq and aio-pika log when a worker's broker connection drops or is restored."""
UNSETTLED = ("Consumer callback failed",)
"""What aiormq logs when the handling of a delivery raises out of the worker: the delivery is
never settled (it stays unacked on that channel for as long as the channel lives)."""


@dataclass(frozen=True)
class LogRecord:
    """One line of a worker's log (JSON lines, or text), what matters of it."""

    level: str
    logger: str
    message: str
    error: str
    """The last line of the exception logged with it: its type and message."""

    @classmethod
    def parse(cls, line: str) -> LogRecord:
        try:
            record = json.loads(line)
        except ValueError:
            return cls("", "", line.strip(), "")
        if not isinstance(record, dict):
            return cls("", "", line.strip(), "")
        exception = str(record.get("exception") or "").strip()
        return cls(
            str(record.get("level", "")),
            str(record.get("logger", "")),
            str(record.get("message", "")),
            exception.splitlines()[-1] if exception else "",
        )

    def __str__(self) -> str:
        text = f"{self.level} {self.logger}: {self.message[:300]}"
        return text + (f" [{self.error[:300]}]" if self.error else "")

    def says(self, markers: Sequence[str]) -> bool:
        return any(marker in self.message for marker in markers)


class Target:
    """A worker process of the fuzz app, started (again) with :meth:`start`; watched."""

    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.settings = settings
        self.workdir = workdir
        self.names = Names(settings.queue_prefix)
        self.queue = self.names.tasks(AGENT)
        self.runs_path = workdir / "runs.txt"
        self.token = uuid.uuid4().hex[:6]
        self.process: WorkerProcess | None = None
        self.starts = 0
        self.connection: tuple[str, str] | None = None
        """The broker's pid of the worker's connection, and when it connected."""
        self._log_offset = 0
        self._runs_offset = 0
        self._runs: Counter[str] = Counter()

    @property
    def worker_id(self) -> str:
        return f"fuzz-{self.token}-{self.starts}"

    async def start(self) -> None:
        self.starts += 1
        log_path = self.workdir / f"worker-{self.starts}.log"
        self.process = WorkerProcess.with_settings(
            self.settings,
            log_path,
            app=APP,
            env={"FUZZ_RUNS": str(self.runs_path), "WAYSTATION_WORKER_ID": self.worker_id},
        )
        self._log_offset = 0
        process = self.process
        process.start()
        await wait_for_consumers(self.settings.amqp_url, [self.queue], 1, alive=process.alive)
        self.connection = await self._find_connection()

    async def stop(self) -> None:
        if self.process is not None:
            await asyncio.to_thread(self.process.stop, 5)

    async def reset(self) -> None:
        """A new worker on fresh queues: whatever the last one could not settle is gone."""
        await self.stop()
        await delete_topology(self.settings.amqp_url, self.settings.queue_prefix, [AGENT])
        await self.start()

    @property
    def log_path(self) -> Path:
        assert self.process is not None
        return self.process.log_path

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def exit_code(self) -> int | None:
        if self.process is None or self.process.process is None:
            return None
        return self.process.process.poll()

    # ---- what it says, and what it did ----

    def new_log_records(self) -> list[LogRecord]:
        """The records its log gained since the last call."""
        if self.process is None or not self.log_path.exists():
            return []
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            data = log.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._log_offset += len(complete)
        return [LogRecord.parse(line) for line in complete.decode(errors="replace").splitlines()]

    def runs(self, fuzz_id: str) -> int:
        """How many times the handler ran for ``fuzz_id`` (the fuzz app's runs file)."""
        if self.runs_path.exists():
            with open(self.runs_path, "rb") as runs:
                runs.seek(self._runs_offset)
                data = runs.read()
            complete = data[: data.rfind(b"\n") + 1]
            self._runs_offset += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if line.strip():
                    self._runs[line.split()[0]] += 1
        return self._runs[fuzz_id]

    async def _find_connection(self, within: float = 20) -> tuple[str, str]:
        name = f"waystation worker {self.worker_id}"
        deadline = time.monotonic() + within
        while True:
            for pid, connected_at, found in await broker_connections():
                if found == name:
                    return pid, connected_at
            if time.monotonic() > deadline:
                raise RuntimeError(f"no broker connection named {name!r}")
            await asyncio.sleep(0.2)

    async def unsettled(self) -> int | None:
        """Deliveries the broker has handed to the worker's first connection and not seen
        settled; None when that connection is gone."""
        assert self.connection is not None
        pid = self.connection[0]
        listing = await run_rabbitmqctl(
            "list_channels", "-q", "--no-table-headers", "connection", "messages_unacknowledged"
        )
        found = False
        total = 0
        for line in listing.splitlines():
            owner, _, unacked = line.partition("\t")
            if owner == pid:
                found = True
                total += int(unacked)
        return total if found else None


async def broker_connections() -> list[tuple[str, str, str]]:
    """(pid, connected_at, connection_name) of every connection the broker has."""
    listing = await run_rabbitmqctl(
        "list_connections", "-q", "--no-table-headers", "pid", "connected_at", "client_properties"
    )
    found = []
    for line in listing.splitlines():
        pid, _, rest = line.partition("\t")
        connected_at, _, properties = rest.partition("\t")
        match = re.search(r'\{"connection_name","([^"]*)"\}', properties)
        found.append((pid, connected_at, match.group(1) if match else ""))
    return found


# ---- one message, and what became of it --------------------------------------------------------


@dataclass
class Outcome:
    """What became of one message, and what went wrong around it."""

    label: str
    message: Message
    verdict: Verdict
    fate: str = ""
    """``ran``, ``ran twice``, ``dead-lettered (<reason>)``, ``refused by the broker``, or
    empty when none was found."""
    problems: list[str] = field(default_factory=list)
    log: list[LogRecord] = field(default_factory=list)
    """The worker's log records about the problems (a connection dropped, a delivery left
    unsettled)."""
    seconds: float = 0.0
    saved: Path | None = None
    """Where the message was written, to replay it (``scripts/fuzz --replay``)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        fate = self.fate or "NO FATE"
        mark = "ok  " if self.ok else "FAIL"
        return f"{mark} {self.label} {self.message.fuzz_id}: {self.verdict} -> {fate}"

    def report(self) -> str:
        lines = [self.line(), "  the message:", self.message.describe("    ")]
        lines += ["  what went wrong:", *(f"    - {problem}" for problem in self.problems)]
        if self.log:
            lines += ["  the worker's log:", *(f"    {record}" for record in self.log[:6])]
        if len(self.message.header) <= 512:
            lines.append(f"  content header (hex): {self.message.header.hex()}")
        lines.append(f"  body (hex): {self.message.body.hex()}")
        if self.saved is not None:
            lines.append(f"  replay: scripts/fuzz --replay {self.saved}")
        return "\n".join(lines)

    def kinds(self) -> list[str]:
        """The kinds of what went wrong, with the exceptions of the log, for grouping."""
        found = {problem.split(":")[0] for problem in self.problems}
        errors = {_generic(record.error) for record in self.log if record.error}
        return sorted(found | errors)


_KINDS = (
    (re.compile(r"'utf-8' codec can't decode .*"), "not UTF-8"),
    (
        re.compile(r"TypeError: .*Unknown type: <class '(\w+)'>.*"),
        r"TypeError: pamqp cannot write \1",
    ),
    (re.compile(r"year -?\d+ is out of range"), "year out of range"),
)


def _generic(text: str) -> str:
    """An exception's text with its particulars (numbers, bytes, quoted values) taken out."""
    kinds: list[str] = []  # (kept whole: put back after the particulars are out)
    for pattern, kind in _KINDS:
        found = pattern.search(text)
        if found:
            kinds.append(found.expand(kind))
            text = text[: found.start()] + "\x00" + text[found.end() :]
    text = re.sub(r"b'[^']*'|'[^']*'|\"[^\"]*\"", "…", text)
    text = re.sub(r"\d+", "N", text)
    for kind in kinds:
        text = text.replace("\x00", kind, 1)
    return text[:200]


_FUZZ_ID = re.compile(rb'"(fz[0-9a-f]{6}-\d+)"')


class Campaign:
    """Hostile messages sent one at a time to a worker of the fuzz app, each checked.

    ``say`` gets a line per message (and the failures in full). After a failure the campaign
    puts a new worker on fresh queues and goes on; with ``stop_at_first_failure`` it stops
    instead (:attr:`stopped`: send nothing more), leaving the broken worker as it is.
    """

    def __init__(
        self,
        settings: Settings,
        workdir: Path,
        *,
        verdict_within: float = 5.0,
        fate_within: float = 20.0,
        probe_within: float = 15.0,
        settle_within: float = 10.0,
        stop_at_first_failure: bool = False,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.workdir = workdir
        self.target = Target(settings, workdir)
        self.verdict_within = verdict_within
        self.fate_within = fate_within
        self.probe_within = probe_within
        self.settle_within = settle_within
        self.stop_at_first_failure = stop_at_first_failure
        self.say = say or (lambda _: None)
        self.token = uuid.uuid4().hex[:6]
        self.outcomes: list[Outcome] = []
        self.letters: dict[str, list[Letter]] = {}
        """Dead letters by the fuzz id in their body."""
        self.stopped = False
        self.taken: set[bytes] = set()
        """The message ids sent so far."""
        self._publisher = RawClient(settings.amqp_url, name="waystation frame fuzzer")
        self._reader = RawClient(settings.amqp_url, name="waystation frame fuzzer: dead letters")
        self._client: Client | None = None
        self._probes = 0

    @property
    def publisher_connections(self) -> int:
        """Connections the hostile publisher opened: one, and one after each the broker
        closed."""
        return self._publisher.connections_opened

    @property
    def worker_starts(self) -> int:
        return self.target.starts

    def fuzz_id(self, number: int) -> str:
        return f"fz{self.token}-{number}"

    def message(self, draft: Draft, number: int) -> Message:
        """``draft`` as the campaign's message ``number``: its fuzz id, and a message_id no
        earlier message of the campaign had."""
        return draft.message(self.fuzz_id(number), self.taken)

    async def __aenter__(self) -> Campaign:
        self.workdir.mkdir(parents=True, exist_ok=True)
        await self.target.start()
        self._client = Client(self.settings.amqp_url, queue_prefix=self.settings.queue_prefix)
        await self._client.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            if self._client is not None:
                await self._client.close()
        await self._publisher.close()
        await self._reader.close()
        await self.target.stop()

    # ---- one message ----

    async def send(self, message: Message, label: str = "") -> Outcome:
        started = time.monotonic()
        self.target.new_log_records()  # what came before is not this message's
        verdict = await self._publisher.publish(
            self.target.queue, message.header, message.body, within=self.verdict_within
        )
        outcome = Outcome(label or message.fuzz_id, message, verdict)
        records: list[LogRecord] = []
        if verdict.accepted:
            outcome.fate = await self._fate(message, records)
            if not outcome.fate:
                outcome.problems.append(self._no_fate(message, records))
        else:
            outcome.fate = "refused by the broker"
        # after a dropped connection or a delivery left unsettled the worker is known broken:
        # its answer is still asked for, without waiting as long
        await self._answers_a_normal_task(outcome, 3.0 if outcome.problems else self.probe_within)
        if verdict.accepted:
            await self._settled(outcome)
        records += self.target.new_log_records()
        self._read_log(records, outcome)
        if not self.target.alive():
            outcome.problems.append(f"worker exited: exit code {self.target.exit_code()}")
        outcome.seconds = time.monotonic() - started
        self.outcomes.append(outcome)
        if outcome.ok:
            self.say(outcome.line())
            return outcome
        failures = self.workdir / "failures"
        failures.mkdir(exist_ok=True)
        outcome.saved = message.save(failures / f"{message.fuzz_id}.json")
        self.say(outcome.report())
        if self.stop_at_first_failure:
            self.stopped = True
        else:
            await self.target.reset()
            self.say(f"     (a new worker on fresh queues: {self.target.worker_id})")
        return outcome

    async def _fate(self, message: Message, records: list[LogRecord]) -> str:
        """What became of the message, once known; empty if nothing within the limit, or as
        soon as the worker's log says its connection dropped or a delivery was left
        unsettled (the fate will not come)."""
        deadline = time.monotonic() + self.fate_within
        while True:
            await self._read_letters()
            # (the runs after the letters: a run's result may be a dead letter too, unroutable)
            runs = self.target.runs(message.fuzz_id)
            if runs >= message.runs_wanted:
                return "ran" if runs == 1 else f"ran {runs} times"
            for letter in self.letters.get(message.fuzz_id, []):
                reason = letter.header_text(HEADER_REASON)
                if reason:
                    return f"dead-lettered ({reason})"
            records += self.target.new_log_records()
            if any(r.says(DROPPED + UNSETTLED) for r in records) or not self.target.alive():
                return ""
            if time.monotonic() > deadline:
                return ""
            await asyncio.sleep(0.05)

    def _no_fate(self, message: Message, records: list[LogRecord]) -> str:
        runs = self.target.runs(message.fuzz_id)
        letters = self.letters.get(message.fuzz_id, [])
        if letters:
            return (
                f"no fate: dead-lettered without an {HEADER_REASON} header "
                f"(headers {sorted(letters[0].headers)})"
            )
        if any(r.says(DROPPED + UNSETTLED) for r in records) or not self.target.alive():
            why = "stopped waiting once the worker's log said why"
        else:
            why = f"waited {self.fate_within:.0f}s"
        return (
            f"no fate: the handler ran {runs} of {message.runs_wanted} times and no dead "
            f"letter came ({why})"
        )

    async def _read_letters(self) -> None:
        for letter in await self._reader.drain(self.target.names.dead_letter_queue):
            for fuzz_id in set(_FUZZ_ID.findall(letter.body)):
                self.letters.setdefault(fuzz_id.decode(), []).append(letter)

    async def _answers_a_normal_task(self, outcome: Outcome, within: float) -> None:
        assert self._client is not None
        self._probes += 1
        probe = f"probe-{self.token}-{self._probes}"
        try:
            result = await self._client.call(AGENT, {"fuzz": probe}, timeout=within)
        except TimeoutError:
            outcome.problems.append(
                f"no answer: a normal task after it was not answered within {within:.0f}s"
            )
            return
        if not result.ok or result.result != {"ran": probe}:
            outcome.problems.append(f"wrong answer: a normal task after it got {result}")

    async def _settled(self, outcome: Outcome) -> None:
        """The worker holds nothing unsettled, on the connection it started with."""
        assert self.target.connection is not None
        deadline = time.monotonic() + self.settle_within
        while True:
            held = await self.target.unsettled()
            if held == 0:
                return
            if held is None:
                now = [
                    f"{pid} since {at}"
                    for pid, at, name in await broker_connections()
                    if name.endswith(self.target.worker_id)
                ]
                pid, at = self.target.connection
                outcome.problems.append(
                    f"connection changed: the worker's broker connection {pid} (since {at}) is "
                    f"gone; now {now or 'none'}"
                )
                return
            if time.monotonic() > deadline:
                outcome.problems.append(
                    f"left unsettled: {held} deliveries held by the worker unsettled after "
                    f"{self.settle_within:.0f}s"
                )
                return
            await asyncio.sleep(0.2)

    def _read_log(self, records: list[LogRecord], outcome: Outcome) -> None:
        dropped = [r for r in records if r.says(DROPPED)]
        raised = [r for r in records if r.says(UNSETTLED)]
        if dropped:
            outcome.problems.append(
                f"connection dropped: the worker's log says so {len(dropped)} times, first: "
                f"{dropped[0].message[:160]}"
            )
        if raised:
            outcome.problems.append(
                f"delivery never settled: its handling raised out of the worker ({raised[0]})"
            )
        outcome.log = dropped + raised

    # ---- the end ----

    async def finish(self) -> list[str]:
        """What must hold at the end: the task queue empty, nothing unsettled, the worker on
        the connection it started with (since the last reset), its log clean."""
        problems: list[str] = []
        if self.stopped:
            return problems  # the failure is reported; the worker it left is not checked
        depth = await queue_depth(self.settings.amqp_url, self.target.queue)
        if depth:
            problems.append(f"{depth} messages left in {self.target.queue}")
        held = await self.target.unsettled()
        if held is None:
            problems.append("the worker's broker connection changed since it started")
        elif held:
            problems.append(f"{held} deliveries left unsettled by the worker")
        scratch = Outcome("end", Message("-", b"", b"", 0, ()), Verdict("confirmed"))
        self._read_log(self.target.new_log_records(), scratch)
        problems += scratch.problems
        if not self.target.alive():
            problems.append(f"the worker exited: exit code {self.target.exit_code()}")
        return problems


# ---- the figures -------------------------------------------------------------------------------


def _verdict_kind(verdict: Verdict) -> str:
    """A verdict with what the broker quoted back (any bytes, quotes included) taken out."""
    if verdict.code is None:
        return verdict.outcome
    return re.sub(r"\d+", "N", re.sub(r"'.*", "…", str(verdict)))[:160]


def summary(outcomes: Sequence[Outcome]) -> str:
    """What was sent and what became of it, counted: the broker's verdicts, the fates (with
    the dead letters' reasons), and the failures grouped by kind."""
    lines = [f"{len(outcomes)} messages sent"]
    verdicts = Counter(_verdict_kind(o.verdict) for o in outcomes)
    lines.append("the broker's verdicts:")
    lines += [f"  {count:5d}  {kind}" for kind, count in verdicts.most_common()]
    fates = Counter(o.fate or "NO FATE" for o in outcomes if o.verdict.accepted)
    lines.append("fates of the messages it accepted:")
    lines += [f"  {count:5d}  {fate}" for fate, count in fates.most_common()]
    failed = [o for o in outcomes if not o.ok]
    lines.append(f"failures: {len(failed)}")
    groups: dict[tuple[str, ...], list[Outcome]] = {}
    for outcome in failed:
        groups.setdefault(tuple(outcome.kinds()), []).append(outcome)
    for kinds, members in sorted(groups.items(), key=lambda item: -len(item[1])):
        first = members[0]
        lines.append(f"  {len(members):5d}  {' | '.join(kinds)}")
        lines.append(f"         e.g. {first.label} {first.message.fuzz_id}: {first.saved or ''}")
    return "\n".join(lines)


def report_failures(outcomes: Sequence[Outcome]) -> str:
    return "\n\n".join(o.report() for o in outcomes if not o.ok)


def as_json(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    return [
        {
            "label": o.label,
            "fuzz_id": o.message.fuzz_id,
            "parts": list(o.message.parts),
            "verdict": str(o.verdict),
            "accepted": o.verdict.accepted,
            "fate": o.fate,
            "problems": o.problems,
            "log": [str(record) for record in o.log],
            "seconds": round(o.seconds, 3),
            "saved": str(o.saved) if o.saved else None,
        }
        for o in outcomes
    ]
