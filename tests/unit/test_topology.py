"""The queue policy through RabbitMQ's management API (``WAYSTATION_BROKER_POLICY=management``),
against a stand-in of the API that keeps what it was sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from waystation.brokers.amqp.topology import apply_policy, management_url_of, policy_definition
from waystation.protocol.wire import Names

from ..support import management_api


class ManagementApi:
    """``PUT /api/policies/{vhost}/{name}`` as RabbitMQ answers it (201), or ``refuse``."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str | None, Any]] = []
        self.refuse: int | None = None

    async def put_policy(self, request: web.Request) -> web.Response:
        self.requests.append(
            (request.raw_path, request.headers.get("Authorization"), await request.json())
        )
        if self.refuse is not None:
            return web.json_response({"error": "bad_request"}, status=self.refuse)
        return web.Response(status=201)


@pytest_asyncio.fixture
async def management() -> AsyncIterator[tuple[ManagementApi, str]]:
    api = ManagementApi()
    async with management_api(api.put_policy) as port:
        yield api, f"http://operator:secret@127.0.0.1:{port}"


def test_the_management_api_is_found_beside_the_amqp_url() -> None:
    assert management_url_of("amqp://waystation:pw@rabbitmq:5672/") == (
        "http://waystation:pw@rabbitmq:15672"
    )
    assert management_url_of("amqp://rabbitmq") == "http://guest:guest@rabbitmq:15672"


async def test_the_policy_follows_the_prefix_and_the_delivery_limit(
    management: tuple[ManagementApi, str],
) -> None:
    api, url = management
    names = Names("shop.")
    assert await apply_policy(names, 7, "management", vhost="/", management_url=url)
    [(path, authorization, body)] = api.requests
    assert path == "/api/policies/%2F/shop.defaults"
    assert authorization == "Basic b3BlcmF0b3I6c2VjcmV0"  # operator:secret
    pattern, definition = policy_definition(names, 7)
    assert body == {
        "pattern": pattern,
        "definition": definition,
        "priority": 0,
        "apply-to": "queues",
    }


async def test_a_refused_policy_stops_the_worker_with_the_apis_answer(
    management: tuple[ManagementApi, str],
) -> None:
    api, url = management
    api.refuse = 401
    with pytest.raises(RuntimeError, match=r"refused the policy 'shop\.defaults' \(401"):
        await apply_policy(Names("shop."), 5, "management", management_url=url)


async def test_an_unreachable_api_is_named() -> None:
    with pytest.raises(RuntimeError, match="cannot reach RabbitMQ's management API"):
        await apply_policy(
            Names("shop."), 5, "management", management_url="http://guest:guest@127.0.0.1:9"
        )
