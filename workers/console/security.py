"""Who may act in the console, and proof that a form came from it.

The console reads without asking anyone. To act (cancel a task, send a signal, replay dead
letters) a person signs in with ``WAYSTATION_CONSOLE_TOKEN`` and a name; unset, the console is
read-only and refuses every action.

Sessions are stateless, so they hold across a restart and across several console processes
that share the token: the cookie carries a random session id, the person's name and when it was
issued, signed with HMAC-SHA256 keyed by the token. Changing the token signs everyone out.
Each form carries a CSRF token, the HMAC of the session id, which a page on another origin
cannot read or compute; the cookie is also ``SameSite=Strict`` and ``HttpOnly``, and a POST
whose ``Origin`` names another site is refused before anything else is looked at.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

__all__ = [
    "COOKIE",
    "SESSION_SECONDS",
    "Session",
    "Signer",
    "clean_name",
]

COOKIE = "waystation_console"
SESSION_SECONDS = 12 * 3600
"""How long a sign-in lasts."""

_NAME_CHARACTERS = re.compile(r"[^A-Za-z0-9 ._@+-]")
MAX_NAME = 64


def clean_name(name: str) -> str:
    """A person's name as the console records it: letters, digits and ``._@+-`` and spaces,
    at most 64 characters; "anonymous" when nothing is left."""
    cleaned = " ".join(_NAME_CHARACTERS.sub("", name).split())[:MAX_NAME].strip()
    return cleaned or "anonymous"


@dataclass(frozen=True, slots=True)
class Session:
    """A signed-in person."""

    session_id: str
    name: str
    issued_at: int

    @property
    def actor(self) -> str:
        """What the log records as the actor of this person's actions."""
        return f"console:{self.name}"


class Signer:
    """Signs and checks sessions and CSRF tokens with the console's token."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty token would let anyone act")
        self._key = hashlib.sha256(b"waystation-console\0" + token.encode()).digest()
        self._token = token.encode()

    def accepts(self, token: str) -> bool:
        """Whether ``token`` is the console's token (in constant time)."""
        return hmac.compare_digest(token.encode(), self._token)

    def _mac(self, *parts: str) -> str:
        message = "\0".join(parts).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def issue(self, name: str, now: float | None = None) -> tuple[Session, str]:
        """A new session for ``name``, and the cookie value that carries it."""
        session = Session(secrets.token_urlsafe(16), clean_name(name), int(now or time.time()))
        encoded = base64.urlsafe_b64encode(session.name.encode()).decode()
        issued = str(session.issued_at)
        mac = self._mac("session", session.session_id, encoded, issued)
        return session, ".".join(("v1", session.session_id, encoded, issued, mac))

    def session(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session a cookie carries; None when it is missing, forged or expired."""
        if not cookie:
            return None
        parts = cookie.split(".")
        if len(parts) != 5 or parts[0] != "v1":
            return None
        _, session_id, encoded, issued, mac = parts
        if not hmac.compare_digest(mac, self._mac("session", session_id, encoded, issued)):
            return None
        try:
            issued_at = int(issued)
            name = base64.urlsafe_b64decode(encoded.encode()).decode()
        except ValueError:
            return None
        if not 0 <= (now or time.time()) - issued_at < SESSION_SECONDS:
            return None
        return Session(session_id, clean_name(name), issued_at)

    def csrf(self, session: Session) -> str:
        """The CSRF token every form of ``session`` carries."""
        return self._mac("csrf", session.session_id)

    def csrf_ok(self, session: Session, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token, self.csrf(session))
