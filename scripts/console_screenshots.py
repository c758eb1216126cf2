"""Save a PNG of each page of the console, 1280 px wide, as a person signed in sees it.

The scene (``scripts.lab.harness.console``, the same as the browser tests') runs on a database
and queues of its own, created here and removed at the end: a completed task, a task paused on
a peer call, an approval waiting and a dead letter. The pages: overview.png, paused.png,
task.png (the task paused on its peer call), approvals.png and dead-letters.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.lab.harness.console import (
    CHROMIUM,
    CHROMIUM_ARGS,
    Scene,
    chromium_missing,
    running_scene,
    scene_settings,
)
from scripts.lab.harness.database import fresh_database_url
from waystation import migrations

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 1280


def pages(scene: Scene) -> list[tuple[str, str]]:
    """(file, path) of each screenshot."""
    return [
        ("overview.png", "/"),
        ("paused.png", "/paused"),
        ("task.png", "/tasks/" + scene.created["paused_on_call"]),
        ("approvals.png", "/approvals"),
        ("dead-letters.png", "/dead-letters"),
    ]


async def photograph(scene: Scene, out: Path) -> list[str]:
    """Save the pages into ``out``; returns the problems (a page that did not answer 200)."""
    from playwright.async_api import async_playwright

    problems = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            context = await browser.new_context(viewport={"width": WIDTH, "height": 800})
            page = await context.new_page()
            await page.goto(f"{scene.base_url}/sign-in")
            await page.get_by_label("Your name").fill("ada")
            await page.get_by_label("Token").fill(scene.token)
            await page.get_by_role("button", name="Sign in").click()
            await page.wait_for_url(f"{scene.base_url}/")
            for name, path in pages(scene):
                response = await page.goto(scene.base_url + path)
                await page.wait_for_load_state("networkidle")
                status = response.status if response is not None else None
                if status != 200:
                    problems.append(f"{path} answered {status}")
                width, height = await page.evaluate(
                    "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
                )
                if width > WIDTH:  # said, not hidden: the picture is cut at WIDTH
                    print(f"console-screenshots: {path} is {width} px wide in a {WIDTH} px window")
                clip = {"x": 0, "y": 0, "width": WIDTH, "height": height}
                await page.screenshot(path=str(out / name), full_page=True, clip=clip)
                print(f"console-screenshots: {out / name} ({path}, {status})")
        finally:
            await browser.close()
    return problems


async def main_async(out: Path) -> int:
    admin_url = os.environ.get(
        "WAYSTATION_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    settings = scene_settings(
        fresh_database_url(admin_url, "ws_screens_"),
        os.environ.get("WAYSTATION_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    await migrations.upgrade(settings.database_url)
    try:
        async with running_scene(settings, token="screenshots") as scene:
            await scene.populate()
            problems = await photograph(scene, out)
    finally:
        await migrations.drop_database(settings.database_url)
    for problem in problems:
        print(f"console-screenshots: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/console-screenshots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "console", help="default: docs/console"
    )
    options = parser.parse_args()
    missing = chromium_missing()
    if missing is not None:
        print(f"console-screenshots: cannot run: {missing}", file=sys.stderr)
        return 1
    options.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    status = asyncio.run(main_async(options.out))
    print(f"console-screenshots: done in {time.monotonic() - began:.0f}s")
    return status


if __name__ == "__main__":
    sys.exit(main())
