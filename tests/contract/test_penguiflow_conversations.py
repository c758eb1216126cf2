"""PenguiFlow's conversation bindings at work on Waystation's store on PostgreSQL: its A2A
toolset continues a router session's conversation with a remote agent, turn after turn, each turn
in a process of its own (an adapter of its own on the same database).

The remote agent is PenguiFlow's own A2A service, served in this process through httpx's ASGI
transport; the planner's model is a script of its replies. The store is the real one
(``workers/contrib/penguiflow``), on this test run's database.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest_asyncio

from waystation.events.postgres import PostgresEventStore

from ..support import penguiflow_capability, require

require(penguiflow_capability(), "the PenguiFlow conversation tests")

import httpx  # noqa: E402
from penguiflow import Message, Node, NodePolicy, create  # noqa: E402
from penguiflow.catalog import NodeSpec  # noqa: E402
from penguiflow.planner import ReactPlanner  # noqa: E402
from penguiflow_a2a import (  # noqa: E402
    A2AAgentToolset,
    A2AConfig,
    A2AService,
    create_a2a_http_app,
)
from penguiflow_a2a.models import (  # noqa: E402
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
)
from penguiflow_a2a.transport import A2AHttpTransport  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from waystation.contrib.penguiflow import WaystationStateStore  # noqa: E402

from .test_penguiflow_store import new_id  # noqa: E402

AGENT_URL = "http://remote-agent"


class Ask(BaseModel):
    text: str


class Answer(BaseModel):
    echo: str
    context_id: str


class ScriptedModel:
    """The planner's model: answers from a script, one reply per call."""

    def __init__(self, *replies: Mapping[str, object]) -> None:
        self.replies = [json.dumps(reply) for reply in replies]

    async def complete(self, **_: Any) -> tuple[str, float]:
        return self.replies.pop(0), 0.0


def agent_card() -> AgentCard:
    return AgentCard(
        protocol_versions=["0.3"],
        name="echo agent",
        description="answers with the remote context it runs in",
        supported_interfaces=[AgentInterface(url=f"{AGENT_URL}/a2a", protocol_binding="HTTP+JSON")],
        version="1.0.0",
        capabilities=AgentCapabilities(
            streaming=False,
            push_notifications=False,
            extended_agent_card=False,
            state_transition_history=False,
        ),
        default_input_modes=["application/json"],
        default_output_modes=["application/json"],
        skills=[AgentSkill(id="echo", name="Echo", description="Echo", tags=["test"])],
    )


async def echo_with_context(message: Message, _ctx: Any) -> dict[str, str]:
    return {"echo": str(message.payload["text"]), "context_id": message.meta["a2a_context_id"]}


@pytest_asyncio.fixture
async def remote_tool() -> AsyncIterator[NodeSpec]:
    """The planner's tool ``ask_remote``: the remote agent's skill ``echo`` through A2A."""
    flow = create(Node(echo_with_context, name="echo", policy=NodePolicy(validate="none")).to())
    service = A2AService(flow, agent_card=agent_card(), config=A2AConfig())
    app = create_a2a_http_app(service, include_docs=False)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url=AGENT_URL
    ) as http:
        toolset = A2AAgentToolset(agent_url=AGENT_URL, transport=A2AHttpTransport(client=http))
        yield toolset.tool(
            name="ask_remote",
            skill="echo",
            args_model=Ask,
            out_model=Answer,
            desc="ask the remote agent",
            streaming=False,
        )
    await service.stop()


@pytest_asyncio.fixture
async def log(database_url: str) -> AsyncIterator[PostgresEventStore]:
    store = PostgresEventStore.from_url(database_url, pool_size=4)
    yield store
    await store.close()


async def turn(
    log: PostgresEventStore, tool: NodeSpec, session: str, text: str
) -> tuple[str, WaystationStateStore]:
    """One turn of ``session`` in a process of its own: the planner asks the remote agent once;
    the remote context the answer came from."""
    store = WaystationStateStore(log)
    planner = ReactPlanner(
        llm_client=ScriptedModel(
            {"thought": "ask", "next_node": "ask_remote", "args": {"text": text}},
            {"thought": "done", "next_node": "final_response", "args": {"answer": "ok"}},
        ),
        catalog=[tool],
        max_iters=4,
        state_store=store,
    )
    result = await planner.run(text, tool_context={"tenant": "acme", "session_id": session})
    assert result.reason == "answer_complete"
    [step] = [s for s in result.metadata["steps"] if s["action"]["next_node"] == "ask_remote"]
    assert step["observation"]["echo"] == text
    return step["observation"]["context_id"], store


async def test_a_router_session_keeps_its_remote_context_from_turn_to_turn(
    log: PostgresEventStore, remote_tool: NodeSpec
) -> None:
    session = new_id("session")
    first, one = await turn(log, remote_tool, session, "first")
    second, two = await turn(log, remote_tool, session, "second")
    assert second == first  # the second process found the first's binding and continued it
    bindings = await two.list_bindings(router_session_id=session)
    assert [b.context_id for b in bindings] == [first, first]
    assert {(b.agent_url, b.remote_skill, b.tenant_id) for b in bindings} == {
        (AGENT_URL, "echo", "acme")
    }
    # another session starts a conversation of its own
    other, three = await turn(log, remote_tool, new_id("session"), "elsewhere")
    assert other != first
    assert one.errors == two.errors == three.errors == {}


async def test_a_conversation_whose_binding_ended_starts_afresh(
    log: PostgresEventStore, remote_tool: NodeSpec
) -> None:
    session = new_id("session")
    first, store = await turn(log, remote_tool, session, "first")
    for binding in await store.list_bindings(router_session_id=session):
        await store.mark_binding_terminal(
            trace_id=binding.trace_id, context_id=binding.context_id, task_id=binding.task_id
        )
    second, _ = await turn(log, remote_tool, session, "second")
    assert second != first
    assert store.errors == {}
