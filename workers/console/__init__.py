"""The web console: see and steer paused work in a browser (``waystation console``).

Pages are rendered on the server (aiohttp and Jinja2, every asset in the package, nothing
fetched from elsewhere) from the log and its projections, so a console shows the same
whichever worker did the work, and any number of consoles may run. Without
``WAYSTATION_CONSOLE_TOKEN`` it only reads; with it, a signed-in person can cancel tasks, answer
signals and replay dead letters, each action recorded in the log with the person as its actor.
See docs/console.md.
"""

from __future__ import annotations

from waystation.console.app import Sources, make_app

__all__ = ["Sources", "make_app"]
