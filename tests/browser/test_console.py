"""The console in a real browser (issue 32): headless Debian Chromium driven by Playwright over
one pool of real workers, the projections' runner and a console (``conftest.scene``).

Every page opens without a console error, a failed request or a request leaving 127.0.0.1; a
person signs in, answers an approval from the inbox and sees the task resume and its timeline
name them; and hostile values (task inputs and results, an agent name, a signal payload, a
dead letter's body, a person's name) are shown as text and run nothing, even with the
console's Content-Security-Policy turned off in the browser, so that escaping alone is tested.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import quote

import pytest

from scripts.lab.harness.console import Scene
from waystation.console.security import clean_name

from .conftest import HOSTILE_AGENT, Watched, sign_in, watched_page

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(240)]

HOSTILE = '"><img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>'
"""Markup that runs script wherever a page puts it into HTML unescaped."""
HOSTILE_URL = "javascript:window.__pwned=1//"
"""What a link would run if a page made a value its target (``//`` makes what follows it in a
value a comment)."""
HOSTILE_NAME = "<img src=x onerror=alert(1)>"
"""A person's name: the console keeps only letters, digits, ``._@+-`` and spaces of it
(``clean_name``), so it shows as ``img srcx onerroralert1``."""


def task_path(task_id: str) -> str:
    return "/tasks/" + quote(task_id, safe="")


async def check_clean(watched: Watched) -> None:
    assert watched.errors == [], watched.errors
    assert watched.outside == [], f"requests left 127.0.0.1: {watched.outside}"
    assert watched.dialogs == [], f"a dialog opened: {watched.dialogs}"
    assert await watched.pwned() is None, "a hostile value ran"


async def test_every_page_opens(scene: Scene, context: Any) -> None:
    from playwright.async_api import expect

    watched = await watched_page(context, scene.base_url)
    page = watched.page
    paused_on_call = scene.created["paused_on_call"]
    approval = f'article.approval[data-task-id="{scene.created["approval"]}"]'
    pages = [
        ("/", "Overview", "main"),
        ("/paused", "Paused tasks", f'a[href="{task_path(paused_on_call)}"]'),
        (task_path(paused_on_call), None, "main"),
        ("/approvals", "Approvals", f'{approval} form.signal-form[data-signal="approval"]'),
        ("/dead-letters", "Dead letters", "main"),
        ("/sign-in", "Sign in", "form.stacked"),
    ]
    shows = {
        "/": "orchestrator",
        task_path(paused_on_call): paused_on_call,
        "/dead-letters": "invalid-input",
    }
    await sign_in(watched, scene.token, "ada")  # so that the pages' forms show too
    for path, heading, part in pages:
        response = await page.goto(scene.base_url + path)
        assert response is not None and response.status == 200, (path, response)
        h1 = page.locator("h1")
        await expect(h1).to_have_count(1)
        if heading is not None:
            await expect(h1).to_contain_text(heading, ignore_case=True)
        else:
            assert (await h1.inner_text()).strip(), f"{path}: an empty heading"
        await expect(page.locator(part).first).to_be_visible()
        if path in shows:
            await expect(page.locator(part)).to_contain_text(shows[path])
        await page.wait_for_load_state("networkidle")
        assert watched.errors == [], (path, watched.errors)
    # the task page names what its task waits for: the peer call it paused on
    await page.goto(scene.base_url + task_path(paused_on_call))
    await expect(page.locator("main")).to_contain_text("reviewer")
    # a task that does not exist is a 404 page, not an error
    missing = await page.goto(scene.base_url + task_path("no-such-task"))
    assert missing is not None and missing.status == 404
    watched.errors.clear()  # the 404 above, on purpose
    await check_clean(watched)


async def test_a_person_approves_a_paused_task(scene: Scene, context: Any) -> None:
    from playwright.async_api import expect

    # 1. a task pauses for an approval
    task_id = await scene.client.submit("reviewer", {"release": "2.5.0"})
    await scene.until_status(task_id, "paused")
    await scene.until_projected([task_id])
    watched = await watched_page(context, scene.base_url)
    page = watched.page
    await sign_in(watched, scene.token, "ada", "/approvals")
    # 2. the approval appears in the inbox
    article = page.locator(f'article.approval[data-task-id="{task_id}"]')
    await expect(article).to_have_count(1)
    await expect(article).to_contain_text(task_id)
    # 3. the person fills the form and submits it
    form = article.locator('form.signal-form[data-signal="approval"]')
    await expect(form).to_have_count(1)
    await fill_approval(form, approved=True, note="ship it")
    await form.get_by_role("button", name="Send approval").click()
    await page.wait_for_url(re.compile(re.escape(task_path(task_id)) + r"\?done="))
    # 4. the task resumes and completes
    await scene.until_status(task_id, "completed")
    # 5. its timeline shows the signal and who sent it
    await page.reload()
    main = page.locator("main")
    await expect(main).to_contain_text(re.compile("SignalReceived|signal received", re.I))
    await expect(main).to_contain_text("ship it")
    await expect(main.locator('tr[data-event="SignalReceived"]')).to_contain_text("console:ada")
    events = await scene.store.read_stream(task_id)
    [received] = [e for e in events if e.event_type == "SignalReceived"]
    assert received.data["payload"] == {"approved": True, "note": "ship it"}, received.data
    assert received.metadata.get("actor") == "console:ada", received.metadata
    await check_clean(watched)


async def fill_approval(form: Any, *, approved: bool, note: str) -> None:
    """Fill the signal form as a person would, whichever shape it takes for this schema: one
    input per property (a checkbox or a choice for the boolean), or a JSON textarea."""
    payload = form.locator('textarea[name="payload"]')
    if await payload.count():
        await payload.fill(json.dumps({"approved": approved, "note": note}))
        return
    flag = form.locator('[name="field.approved"]')
    kind = await flag.first.evaluate("e => e.tagName.toLowerCase() + ':' + (e.type || '')")
    if kind == "input:checkbox":
        await flag.set_checked(approved)
    elif kind == "input:radio":
        await form.locator(f'[name="field.approved"][value="{str(approved).lower()}"]').check()
    elif kind.startswith("select"):
        await flag.select_option(str(approved).lower())
    else:
        await flag.fill(str(approved).lower())
    await form.locator('[name="field.note"]').fill(note)


async def test_hostile_values_run_nothing(scene: Scene, browser: Any) -> None:

    client = scene.client
    # a task id, an input and (through its researcher) a result, all hostile
    orchestrated = await client.submit(
        "orchestrator", {"topics": [HOSTILE]}, task_id=f"{HOSTILE}:orchestrated"
    )
    # an agent with a hostile name, paused for an approval, with a hostile id and input: the
    # lists of paused tasks and approvals link to it
    hostile_agent_task = await client.submit(
        HOSTILE_AGENT, {"note": HOSTILE}, task_id=f"{HOSTILE_URL}{HOSTILE}"
    )
    # a signal payload: a reviewer approves with a hostile note
    signalled = await client.submit("reviewer", {"release": HOSTILE})
    dead_before = await scene.dead_letters()
    await client.submit("quote", {"item": HOSTILE, "quantity": HOSTILE_URL})
    await scene.until_status(signalled, "paused")
    await client.signal(
        signalled, "approval", {"approved": False, "note": HOSTILE}, agent="reviewer"
    )
    await scene.until_status(orchestrated, "completed")
    await scene.until_status(signalled, "completed")
    await scene.until_status(hostile_agent_task, "paused")
    await scene.until_projected([hostile_agent_task])

    async def dead_lettered() -> bool:
        return await scene.dead_letters() > dead_before

    from scripts.lab.harness.console import wait_for

    await wait_for(dead_lettered, 30, "the hostile quote to be dead-lettered")

    # the browser ignores the console's Content-Security-Policy: escaping alone must hold
    context = await browser.new_context(bypass_csp=True, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(20_000)
    try:
        watched = await watched_page(context, scene.base_url)
        page = watched.page
        await sign_in(watched, scene.token, HOSTILE_NAME)
        visits = [
            ("/", [HOSTILE_AGENT, clean_name(HOSTILE_NAME)]),
            ("/paused", [HOSTILE_AGENT, hostile_agent_task]),
            ("/approvals", [HOSTILE_AGENT, hostile_agent_task, HOSTILE]),
            ("/dead-letters", [HOSTILE]),
            (task_path(orchestrated), [orchestrated, HOSTILE]),
            (task_path(hostile_agent_task), [HOSTILE_AGENT, HOSTILE]),
            (task_path(signalled), [HOSTILE]),
        ]
        for path, shown in visits:
            await check_page(watched, path, shown)
        # a person answers the hostile agent's approval through the console, with a hostile
        # note: the task's page then shows it, and who sent it
        article = page.locator("article.approval", has_text=HOSTILE_AGENT)
        await page.goto(scene.base_url + "/approvals")
        await fill_approval(article.locator("form.signal-form"), approved=True, note=HOSTILE)
        await article.get_by_role("button", name="Send approval").click()
        await page.wait_for_url(re.compile(r"\?done="))
        await scene.until_status(hostile_agent_task, "completed")
        shown = [HOSTILE_AGENT, HOSTILE, f"console:{clean_name(HOSTILE_NAME)}"]
        await check_page(watched, task_path(hostile_agent_task), shown)
        # an export holds the hostile values as they are: never served as a page to render
        export = await page.request.get(scene.base_url + task_path(orchestrated) + "/export")
        assert export.status == 200, export
        assert "html" not in export.headers["content-type"], export.headers
        lines = await export.text()
        assert HOSTILE in lines or json.dumps(HOSTILE)[1:-1] in lines, lines[:500]
        await check_clean(watched)
    finally:
        await context.close()


async def check_page(watched: Watched, path: str, shown: list[str]) -> None:
    """Open ``path``: it shows each of ``shown`` as text, holds no element a hostile value
    made, ran nothing, and neither does any link whose text shows a hostile value."""
    page = watched.page
    await page.goto(watched.base_url + path)
    await page.wait_for_load_state("networkidle")
    # the page's text, with what a closed <details> holds
    text = await page.locator("body").text_content() or ""
    for value in shown:
        # shown literally: as text, which JSON (in a <pre>) may escape its quotes in
        assert value in text or json.dumps(value)[1:-1] in text, (path, value)
    assert await page.locator("img").count() == 0, f"{path}: an injected <img>"
    assert await page.locator("script").count() == 1, f"{path}: an injected <script>"
    assert await watched.pwned() is None, f"{path}: a hostile value ran"
    await click_hostile_links(watched, path)


async def click_hostile_links(watched: Watched, path: str) -> None:
    """Click every link of the page at ``path`` whose text shows a hostile value; each must
    stay on the console and run nothing."""
    page = watched.page
    links = page.locator("a", has_text=re.compile("pwned|onerror"))
    for index in range(await links.count()):
        await page.goto(watched.base_url + path)
        link = page.locator("a", has_text=re.compile("pwned|onerror")).nth(index)
        href = await link.get_attribute("href")
        assert href is not None and href.startswith(("/", "?")), (path, href)
        await link.click()
        await page.wait_for_load_state("networkidle")
        assert page.url.startswith(watched.base_url), (path, href, page.url)
        assert await watched.pwned() is None, f"{path}: the link {href} ran a hostile value"
