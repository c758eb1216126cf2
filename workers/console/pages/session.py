"""Signing in and out: a person gives the console's token and a name, which the log records as
the actor of what they do (``console:<name>``)."""

from __future__ import annotations

from aiohttp import web

from waystation.console.app import SIGNER, render, session_of
from waystation.console.security import COOKIE, SESSION_SECONDS, Signer

__all__ = ["routes"]

routes = web.RouteTableDef()


def _local(path: str | None) -> str:
    """Where to go after signing in: a path of this console only (never ``//host`` or a URL)."""
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path


@routes.get("/sign-in")
async def sign_in_page(request: web.Request) -> web.Response:
    return render(
        request, "sign_in.html", next=_local(request.query.get("next")), problem=None, name=""
    )


@routes.post("/sign-in")
async def sign_in(request: web.Request) -> web.StreamResponse:
    signer: Signer = request.app[SIGNER]  # type: ignore[assignment]
    form = await request.post()
    token, name = str(form.get("token", "")), str(form.get("name", ""))
    target = _local(str(form.get("next", "/")))
    if not signer.accepts(token):
        return render(
            request,
            "sign_in.html",
            status=403,
            next=target,
            problem="That is not this console's token (WAYSTATION_CONSOLE_TOKEN).",
            name=name,
        )
    _, cookie = signer.issue(name)
    response = web.HTTPSeeOther(target)
    response.set_cookie(
        COOKIE,
        cookie,
        max_age=SESSION_SECONDS,
        httponly=True,
        samesite="Strict",
        secure=request.secure,
        path="/",
    )
    raise response


@routes.post("/sign-out")
async def sign_out(request: web.Request) -> web.StreamResponse:
    assert session_of(request) is not None  # the guard let only a session through
    response = web.HTTPSeeOther("/")
    response.del_cookie(COOKIE, path="/")
    raise response
