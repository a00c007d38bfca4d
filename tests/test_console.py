"""The memory console in a real browser: Debian's chromium, driven by Playwright, against the
service on a real uvicorn (real SQLite, the real embedder).

Login, search with explain (the numbers of the REST API and `engram search --explain`), a
superseded fact's history chain and its source episodes, edit, erase with a typed confirmation,
tenant isolation, a stored `<script>` rendered as text, the reader role and CSRF refused,
labels and keyboard navigation. With CONSOLE_SHOTS=<dir> (`make console-shots`) the tests also
write screenshots of the main pages there (docs/console/*.png in the README).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx2
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from console_kit import CHROMIUM, CHROMIUM_ARGS, SCRIPT_TEXT, SECRET_B, Live, live_service
from engram import JobStatus, Memory
from engram.model import new_id
from engram.providers.embedders import MiniLM

SHOTS = os.environ.get("CONSOLE_SHOTS")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, embedder: MiniLM) -> Iterator[Live]:
    with live_service(tmp_path_factory.mktemp("console"), embedder) as service:
        yield service


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    yield pg
    context.close()


def login(page: Page, live: Live, who: str) -> None:
    page.goto(f"{live.url}/ui")
    expect(page).to_have_url(f"{live.url}/ui/login")
    page.get_by_label("API key").fill(live.tokens[who])
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(f"{live.url}/ui")


def shot(page: Page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


def api(live: Live, who: str, method: str, path: str, **kwargs: Any) -> Any:
    with httpx2.Client(timeout=60) as http:
        return http.request(method, f"{live.url}{path}",
                            headers={"Authorization": f"Bearer {live.tokens[who]}"}, **kwargs)


def test_login_sets_a_strict_httponly_session_and_shows_the_scopes(page: Page, live: Live) -> None:
    page.goto(f"{live.url}/ui/login")
    page.get_by_label("API key").fill("engram_not_a_key")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("alert")).to_have_text("unknown or revoked API key")
    assert not [c for c in page.context.cookies() if c["value"] and "key" in c["value"]]

    login(page, live, "a-admin")
    [cookie] = page.context.cookies()
    assert cookie["name"] == "engram_console" and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert live.tokens["a-admin"] not in cookie["value"]  # opaque: the key stays on the server
    users = page.get_by_role("table", name="Users")
    expect(users).to_contain_text("ana")
    expect(users).to_contain_text("bob")
    expect(page.get_by_role("table", name="Sessions")).to_contain_text("2024-03-04")
    shot(page, "scopes")
    # the key never travels in a URL: not at login, not in any link of the page
    assert live.tokens["a-admin"] not in page.url
    assert live.tokens["a-admin"] not in page.content()

    page.get_by_role("button", name="Log out").click()
    expect(page).to_have_url(f"{live.url}/ui/login")
    page.goto(f"{live.url}/ui/memories")
    expect(page).to_have_url(f"{live.url}/ui/login")


def test_search_explain_shows_the_numbers_of_the_api(page: Page, live: Live) -> None:
    login(page, live, "a-member")
    page.goto(f"{live.url}/ui/search?user_id=ana")
    page.get_by_label("query").fill("Where does Ana live?")
    page.get_by_label("hits").fill("5")
    page.get_by_role("button", name="Search").click()
    table = page.get_by_role("table", name="Hits")
    expect(table).to_be_visible()
    shot(page, "search")
    columns = [c.strip() for c in table.locator("thead th").all_inner_texts()][2:]
    rows = table.locator("tbody tr")
    shown = [(r.get_attribute("data-id"),
              [c.strip() for c in r.locator("td.num[data-stage]").all_inner_texts()]) for r in rows.all()]
    hits = api(live, "a-member", "POST", "/v1/memories/search",
               json={"query": "Where does Ana live?", "user_id": "ana", "limit": 5}).json()["hits"]
    assert [h["memory"]["id"] for h in hits] == [i for i, _ in shown]
    assert "score" in columns and "dense" in columns and "lexical" in columns
    for hit, (_, cells) in zip(hits, shown, strict=True):
        expected = [f"{hit['explain'][c]:.3f}" if c in hit["explain"] else "-" for c in columns]
        assert cells == expected
    # the current fact ranks; the superseded one is not a current answer
    assert live.ids["lisbon"] in [i for i, _ in shown]
    assert live.ids["porto"] not in [i for i, _ in shown]


def test_history_chain_of_a_superseded_fact(page: Page, live: Live) -> None:
    login(page, live, "a-reader")
    page.goto(f"{live.url}/ui/memories/{live.ids['lisbon']}?user_id=ana")
    versions = page.locator("ol.chain > li")
    expect(versions).to_have_count(2)
    old, new = versions.nth(0), versions.nth(1)
    expect(old).to_have_attribute("data-id", live.ids["porto"])
    expect(old.locator(".state")).to_have_text("superseded")
    expect(old.locator("tr.event-SUPERSEDE")).to_contain_text("superseded by caller")
    expect(old.locator("tr.event-ADD")).to_be_visible()
    expect(new.locator(".state")).to_have_text("current")
    expect(new.locator("tr.event-ADD")).to_contain_text(f"supersedes {live.ids['porto']}")
    # validity intervals meet: the old fact holds until the new one begins
    old_end = old.locator(".validity").inner_text().split("→")[1].strip()
    new_start = new.locator(".validity").inner_text().split("→")[0].strip()
    assert old_end == new_start == "2024-04-08 18:20"
    expect(new.locator(".validity")).to_contain_text("→ now")
    shot(page, "history")
    # the older version is one click away, and from it the chain is the same
    old.get_by_role("link", name=live.ids["porto"]).click()
    expect(page.locator("ol.chain > li.current")).to_have_attribute("data-id", live.ids["porto"])
    expect(page.locator("ol.chain > li")).to_have_count(2)
    # a fact's source episodes are one click away
    page.goto(f"{live.url}/ui/memories/{live.ids['sourced']}")
    page.locator("a.provenance").first.click()
    expect(page.locator("li.current .memory-text")).to_contain_text("I'm vegetarian")


def test_edit_goes_through_the_api_and_shows_in_history(page: Page, live: Live) -> None:
    login(page, live, "a-member")
    page.goto(f"{live.url}/ui/memories?user_id=ana&kind=semantic")
    page.get_by_role("link", name="Clínica+").click()
    page.get_by_label("text").fill("Ana works as an ML engineer at Clínica+ in Lisbon.")
    page.get_by_label("importance (0–1)").fill("0.7")
    page.get_by_role("button", name="Save").click()
    current = page.locator("li.current")
    expect(current.locator(".memory-text")).to_have_text("Ana works as an ML engineer at Clínica+ in Lisbon.")
    update = current.locator("tr.event-UPDATE")
    expect(update).to_contain_text("Ana works as a machine learning engineer")  # before
    expect(update).to_contain_text("0.7")                                       # after
    mid = current.get_attribute("data-id")
    got = api(live, "a-member", "GET", f"/v1/memories/{mid}").json()
    assert got["text"] == "Ana works as an ML engineer at Clínica+ in Lisbon." and got["importance"] == 0.7
    events = api(live, "a-member", "GET", f"/v1/memories/{mid}/history").json()["events"]
    assert [e["type"] for e in events] == ["ADD", "UPDATE"]
    # nothing changed: refused, nothing written
    page.get_by_role("button", name="Save").click()
    expect(page.get_by_role("alert")).to_contain_text("nothing to change")
    assert len(api(live, "a-member", "GET", f"/v1/memories/{mid}/history").json()["events"]) == 2


def test_delete_keeps_the_history(page: Page, live: Live) -> None:
    mid = live.memory("a").add("a note to delete", kind="semantic", user_id="ana").memories[0].id
    login(page, live, "a-member")
    page.goto(f"{live.url}/ui/memories/{mid}")
    page.get_by_role("button", name="Delete (kept in history)").click()
    expect(page.locator("li.current .state")).to_have_text("deleted or erased")
    expect(page.locator("tr.event-DELETE")).to_contain_text("deleted by caller")
    assert api(live, "a-member", "GET", f"/v1/memories/{mid}").status_code == 404


def test_erase_needs_the_id_typed_again(page: Page, live: Live) -> None:
    login(page, live, "a-admin")
    page.goto(f"{live.url}/ui/erase?user_id=bob")
    button = page.get_by_role("button", name="Erase for good")
    expect(page.get_by_label("id", exact=True)).to_have_value("bob")
    expect(button).to_be_disabled()
    page.get_by_label("type the id again to confirm").fill("bo")
    expect(button).to_be_disabled()
    shot(page, "erase")
    page.get_by_label("type the id again to confirm").fill("bob")
    expect(button).to_be_enabled()
    button.click()
    expect(page.get_by_role("status")).to_contain_text("Erased 2 memories of user bob")
    assert api(live, "a-admin", "GET", "/v1/memories", params={"user_id": "bob"}).json()["items"] == []
    page.goto(f"{live.url}/ui")
    expect(page.get_by_role("table", name="Users")).not_to_contain_text("bob")


def test_a_tenant_never_sees_another_tenants_pages(page: Page, live: Live) -> None:
    login(page, live, "b-admin")
    expect(page.get_by_role("table", name="Users")).to_contain_text("ana")  # b's own ana
    for path in (f"/ui/memories/{live.ids['lisbon']}", f"/ui/memories/{live.ids['porto']}?user_id=ana"):
        response = page.goto(f"{live.url}{path}")
        assert response is not None and response.status == 404
        expect(page.get_by_role("alert")).to_contain_text("no memory with id")
    page.goto(f"{live.url}/ui/memories?user_id=ana")
    table = page.get_by_role("table", name="Memories")
    expect(table.locator("tbody tr")).to_have_count(1)
    expect(table).to_contain_text(SECRET_B)
    page.goto(f"{live.url}/ui/search?user_id=ana&q=Where+does+Ana+live%3F")
    expect(page.locator("body")).not_to_contain_text("Lisbon")
    page.goto(f"{live.url}/ui/timeline?user_id=ana")
    expect(page.locator("main")).to_contain_text("No episodes")
    # and tenant a does not see b's secret
    page.context.clear_cookies()
    login(page, live, "a-reader")
    page.goto(f"{live.url}/ui/search?user_id=ana&q=launch+code")
    expect(page.locator("#hits")).not_to_contain_text("launch code is")


def test_a_stored_script_renders_as_text(page: Page, live: Live) -> None:
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    login(page, live, "a-admin")
    # the context preview shows the prompt as the model gets it: engram quotes the text there
    for path, text in (("/ui/memories?user_id=mallory", SCRIPT_TEXT),
                       (f"/ui/memories/{live.ids['script']}", SCRIPT_TEXT),
                       ("/ui/search?user_id=mallory&q=water+the+plants", SCRIPT_TEXT),
                       ("/ui/context?user_id=mallory&q=plants", "&lt;script&gt;window.__pwned = 1")):
        response = page.goto(f"{live.url}{path}")
        assert response is not None and response.status == 200
        assert "script-src 'self'" in response.headers["content-security-policy"]
        expect(page.locator("main")).to_contain_text(text)
        assert page.evaluate("window.__pwned") is None
        assert page.locator("main script, main img").count() == 0
    assert dialogs == []


def test_the_reader_role_sees_but_cannot_change(page: Page, live: Live) -> None:
    login(page, live, "a-reader")
    expect(page.locator(".role")).to_have_text("reader (read-only)")
    page.goto(f"{live.url}/ui/memories/{live.ids['lisbon']}")
    expect(page.locator("li.current .memory-text")).to_be_visible()
    expect(page.locator("form.edit")).to_have_count(0)
    expect(page.get_by_role("link", name="Erase")).to_have_count(0)
    # a forged write with the session's own valid CSRF token is still refused: the role decides
    token = page.locator("input[name=csrf]").first.get_attribute("value")
    status = page.evaluate(
        """async ([id, token]) => (await fetch(`/ui/memories/${id}/edit`, {method: "POST",
             headers: {"Content-Type": "application/x-www-form-urlencoded"},
             body: new URLSearchParams({csrf: token, text: "changed by a reader"})})).status""",
        [live.ids["lisbon"], token])
    assert status == 403
    for method, path, body in (("PATCH", f"/v1/memories/{live.ids['lisbon']}", {"text": "x"}),
                               ("POST", "/v1/memories", {"messages": "x", "user_id": "ana"}),
                               ("POST", "/v1/erase", {"user_id": "ana"})):
        r = api(live, "a-reader", method, path, json=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert api(live, "a-reader", "GET", f"/v1/memories/{live.ids['lisbon']}").json()["text"].startswith(
        "Ana lives in Lisbon")


def test_csrf_is_refused(page: Page, live: Live) -> None:
    login(page, live, "a-member")
    page.goto(f"{live.url}/ui/memories/{live.ids['lisbon']}")
    for body in ("{text: 'forged'}", "{text: 'forged', csrf: 'not-the-token'}"):
        status = page.evaluate(
            f"""async (id) => (await fetch(`/ui/memories/${{id}}/edit`, {{method: "POST",
                 headers: {{"Content-Type": "application/x-www-form-urlencoded"}},
                 body: new URLSearchParams({body})}})).status""", live.ids["lisbon"])
        assert status == 403
    assert api(live, "a-member", "GET", f"/v1/memories/{live.ids['lisbon']}").json()["text"].startswith(
        "Ana lives in Lisbon")


def test_labels_and_keyboard_navigation_of_the_memories_table(page: Page, live: Live) -> None:
    login(page, live, "a-reader")
    page.goto(f"{live.url}/ui/memories?user_id=ana&limit=8")
    shot(page, "memories")
    unlabelled = page.evaluate("""() => Array.from(document.querySelectorAll(
        'input:not([type=hidden]), select, textarea')).filter(el =>
        !(el.id && document.querySelector(`label[for="${el.id}"]`)) && !el.getAttribute('aria-label'))
        .map(el => el.name)""")
    assert unlabelled == []
    rows = page.locator("#memories tbody tr")
    expect(rows).to_have_count(8)
    ids = [r.get_attribute("data-id") for r in rows.all()]
    # Tab from the filter button lands on the table (one tab stop), arrows move inside it
    page.get_by_role("button", name="Filter").focus()
    page.keyboard.press("Tab")
    focused = lambda: page.evaluate("document.activeElement.dataset.id")  # noqa: E731
    assert focused() == ids[0]
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    assert focused() == ids[2]
    page.keyboard.press("ArrowUp")
    assert focused() == ids[1]
    page.keyboard.press("End")
    assert focused() == ids[7]
    page.keyboard.press("Home")
    assert focused() == ids[0]
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")
    expect(page).to_have_url(f"{live.url}/ui/memories/{ids[1]}?user_id=ana")
    # paging follows the API's cursors
    page.goto(f"{live.url}/ui/memories?user_id=ana&limit=8")
    page.get_by_role("link", name="Next page").click()
    expect(rows.first).not_to_have_attribute("data-id", ids[0])
    assert not set(r.get_attribute("data-id") for r in rows.all()) & set(ids)


def test_timeline_context_and_jobs_pages(page: Page, live: Live) -> None:
    login(page, live, "a-reader")
    page.goto(f"{live.url}/ui/timeline?user_id=ana")
    sessions = page.locator("section.session")
    expect(sessions).to_have_count(3)
    expect(sessions.first.locator("h2")).to_contain_text("2024-04-08")  # latest first
    expect(sessions.last.locator("ol.episodes li").first).to_contain_text("I'm Ana. I live in Porto")
    shot(page, "timeline")
    page.goto(f"{live.url}/ui/context?user_id=ana")
    page.get_by_label("next user message").fill("Any dinner ideas for me tonight?")
    page.get_by_label("budget (tokens)").fill("400")
    page.get_by_role("button", name="Preview").click()
    blocks = page.get_by_role("table", name="Blocks")
    expected = api(live, "a-reader", "POST", "/v1/context", json={
        "query": "Any dinner ideas for me tonight?", "user_id": "ana", "budget_tokens": 400}).json()
    for name, block in expected["blocks"].items():
        cells = blocks.locator(f"tr[data-block={name}] td").all_inner_texts()
        assert cells[3] == str(block["tokens"]) and cells[4] == str(block["items"])
    expect(page.locator("main")).to_contain_text(f"{expected['total_tokens']} of 400 tokens used")
    expect(page.locator("section.message pre").first).to_contain_text("recalled from memory")
    shot(page, "context")
    page.goto(f"{live.url}/ui/jobs")
    expect(page.locator("main h1")).to_have_text("Background jobs")


def test_a_failed_job_is_retried_from_the_jobs_page(page: Page, live: Live) -> None:
    """A failed job shows its error and a Retry button (writers only); Retry queues it again
    through `Memory.retry`, and the worker then does it."""
    mem = live.memory("a")
    done = mem.add("Zed fixed the boiler on Sunday", user_id="zed", background=True).job
    assert done is not None and mem.wait(done.id, 60).status is JobStatus.DONE
    failed = replace(mem.job(done.id), id=new_id(), key=None, status=JobStatus.FAILED, attempts=4,
                     error="StoreError: disk on fire", result=None)
    with mem.store.write() as tx:
        tx.put_job(failed)
    login(page, live, "a-reader")
    page.goto(f"{live.url}/ui/jobs?user_id=zed&status=failed")
    row = page.locator("tr.job-failed")
    expect(row).to_contain_text("disk on fire")
    expect(row.get_by_role("button", name="Retry")).to_have_count(0)  # a reader sees, never acts
    page.context.clear_cookies()
    login(page, live, "a-member")
    page.goto(f"{live.url}/ui/jobs?user_id=zed&status=failed")
    page.locator("tr.job-failed").get_by_role("button", name="Retry").click()
    expect(page).to_have_url(f"{live.url}/ui/jobs?user_id=zed")
    assert mem.wait(failed.id, 60).status is JobStatus.DONE
    assert api(live, "a-member", "POST", f"/v1/jobs/{failed.id}/retry").status_code == 409


def test_graph_view_of_an_entitys_neighbourhood(page: Page, live: Live) -> None:
    login(page, live, "a-reader")
    page.goto(f"{live.url}/ui/graph?user_id=ana&agent_id=assistant")
    if not hasattr(Memory, "neighbours"):  # a build without the entity graph says so
        expect(page.locator("main")).to_contain_text("not in this build")
        return
    page.get_by_label("entity").fill("Ana")
    page.get_by_label("hops").select_option("2")
    page.get_by_role("button", name="Show").click()
    nodes = page.locator("svg.graph a.node")
    names = sorted(t.strip() for t in nodes.locator("text").all_text_contents())
    assert names == sorted(["Ana", "Lisbon", "Clínica+", "Inês", "Porto"])
    expect(page.locator("svg.graph a.ring-0")).to_contain_text("Ana")
    expect(page.locator("svg.graph a.ring-2")).to_contain_text("Porto")  # two hops, via Inês
    relations = page.get_by_role("table", name="Relations")
    expect(relations).to_contain_text("works_at")
    expect(relations).to_contain_text("34")  # a literal value: in the table, not drawn
    assert page.locator("svg.graph g.edge").count() == 5
    shot(page, "graph")
    # one hop around another entity: one click
    page.locator("svg.graph a.node", has_text="Inês").click()
    expect(page.locator("svg.graph a.ring-0")).to_contain_text("Inês")


@pytest.mark.slow  # a second service, seeded again
def test_without_auth_the_console_opens_without_login(tmp_path: Path, embedder: MiniLM,
                                                      browser: Browser) -> None:
    with live_service(tmp_path, embedder, auth=False) as service:
        context = browser.new_context()
        page = context.new_page()
        page.goto(f"{service.url}/ui")
        expect(page).to_have_url(f"{service.url}/ui")
        expect(page.locator(".who")).to_contain_text("tenant local")
        expect(page.get_by_role("button", name="Log out")).to_have_count(0)
        # forms still need the token: another site's form post has no cookie and no token
        with httpx2.Client() as http:
            r = http.post(f"{service.url}/ui/memories/{service.ids['lisbon']}/delete", data={"csrf": "x"})
            assert r.status_code == 403
        page.goto(f"{service.url}/ui/memories/{service.ids['lisbon']}")
        page.get_by_role("button", name="Delete (kept in history)").click()
        expect(page.locator("tr.event-DELETE")).to_be_visible()
        context.close()
