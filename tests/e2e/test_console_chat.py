"""The console's chat and charts in a real browser (Debian's chromium under Selenium) against a
real keyless ``vlmserve demo``: the conversation survives a reload, answers render as Markdown
while hostile HTML stays inert text, regenerate / edit-and-resend / copy, an error before any
token says what failed, the Models page charts the server's /metrics, a phone gets the chat
first, and no Content-Security-Policy violation happens anywhere. Screenshots go to
``$VLMSERVE_CONSOLE_SCREENSHOTS`` (the README's docs/img) or a temporary folder."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_support import MISSING, RequestLog, chromium, screenshot
from test_console import (
    FAKE_STREAM,
    clip,
    delta,
    found,
    set_field,
    sse,
    tab,
    text_of,
    wait_for,
    wait_until,
)

from support import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

CHAT = "tiny-qwen2-vl"
# Installed before any page script: every CSP violation the page causes is kept.
WATCH_CSP = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(`${e.violatedDirective} ${e.blockedURI}`);
});
"""
HOSTILE = (
    "# Plan\n\nSome **bold** text and `inline` code.\n\n"
    "```python\nprint('<b>hi</b>')\n```\n\n"
    '<img src=x onerror="window.__pwned = 1"> <script>window.__pwned = 2</script>\n\n'
    "[a link](javascript:window.__pwned=3) ![pic](https://example.test/p.png)\n"
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(["demo"])  # no key: the console says so
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def browser(server: ServerProcess) -> Iterator[Any]:
    with chromium() as driver:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": WATCH_CSP})
        origin = server.url
        permissions = ["clipboardReadWrite", "clipboardSanitizedWrite"]
        driver.execute_cdp_cmd(
            "Browser.grantPermissions", {"origin": origin, "permissions": permissions}
        )
        yield driver


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("VLMSERVE_CONSOLE_SCREENSHOTS")
    return Path(given) if given else tmp_path_factory.mktemp("console-shots")


@pytest.fixture
def page(browser: Any, server: ServerProcess) -> Iterator[Any]:
    """The console with an empty conversation; afterwards: no CSP violation, no error in the
    browser's console, no request off the server's origin."""
    seen = RequestLog(browser)
    browser.get(f"{server.url}/#chat")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    wait_for(browser, f"#chat-model option[value='{CHAT}']")
    yield browser
    assert browser.execute_script("return window.__csp") == []
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
    assert seen.foreign((server.url,)) == []


def answers(driver: Any) -> list[str]:
    """The answers' states, read in one script: the log is redrawn when an answer ends."""
    script = "return [...document.querySelectorAll('#chat-log .msg.assistant')]"
    return driver.execute_script(f"{script}.map((n) => n.dataset.state)")


def answered(driver: Any) -> int:
    """How many answers the page has ended (streamed to the end, stopped or failed)."""
    return int(driver.find_element("id", "chat-log").get_attribute("data-answered") or 0)


def until_answered(driver: Any, before: int) -> str:
    """Wait for the answer after ``before`` ended answers; the state it ended in."""
    wait_until(driver, lambda: answered(driver) > before)
    return answers(driver)[-1]


def ask(driver: Any, text: str) -> str:
    """Send ``text``; the state its answer ended in."""
    before = answered(driver)
    driver.find_element("id", "chat-input").send_keys(text)
    driver.find_element("id", "chat-send").click()
    return until_answered(driver, before)


def test_a_keyless_server_needs_no_key_and_says_so(page: Any) -> None:
    assert page.find_element("id", "keys-box").get_attribute("open") is None  # folded
    assert "no keys" in text_of(page, "#keys-need")
    assert not page.find_element("id", "admin-key").is_enabled()
    tab(page, "models")
    wait_for(page, "table.models caption")
    assert "no admin API" in text_of(page, "table.models caption")
    assert "--admin-key" in text_of(page, "#models-updated")


def test_markdown_renders_as_elements_and_hostile_html_stays_text(page: Any, shots: Path) -> None:
    events = [sse(0, delta(role="assistant", content=""))]
    pieces = [HOSTILE[i : i + 9] for i in range(0, len(HOSTILE), 9)]  # streamed in pieces
    events += [sse(k + 1, delta(content=piece)) for k, piece in enumerate(pieces)]
    n = len(events)
    events += [sse(n, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})]
    events += [sse(n + 1, "[DONE]")]
    page.execute_script(FAKE_STREAM, events)
    assert ask(page, "plan it") == "done"
    content = ".msg.assistant .content"
    assert text_of(page, f"{content} h1") == "Plan"
    assert text_of(page, f"{content} pre > code") == "print('<b>hi</b>')\n"
    assert text_of(page, f"{content} strong") == "bold"
    assert not found(page, f"{content} img, {content} script, {content} b")
    shown = text_of(page, content)
    assert '<img src=x onerror="window.__pwned = 1">' in shown and "<script>" in shown
    hrefs = [a.get_attribute("href") for a in found(page, f"{content} a")]
    assert hrefs == [None, "https://example.test/p.png"]  # a picture elsewhere is a link
    assert page.execute_script("return window.__pwned") is None
    screenshot(page, shots / "console-chat-markdown.png")


def test_an_answer_that_fails_before_any_token_says_why(page: Any) -> None:
    page.execute_script(
        """window.fetch = async () => new Response(
             JSON.stringify({error: {message: "model tiny-qwen2-vl is overloaded"}}),
             {status: 503, headers: {"Content-Type": "application/json"}});"""
    )
    assert ask(page, "hello") == "error"
    status = text_of(page, "#chat-status")
    assert status == "the answer failed: model tiny-qwen2-vl is overloaded"
    assert text_of(page, ".msg.assistant .error") == "model tiny-qwen2-vl is overloaded"


def test_the_conversation_survives_a_reload_and_new_chat_clears_it(page: Any) -> None:
    set_field(page, "chat-max-tokens", "6")
    page.find_element("css selector", "#chat-system-box summary").click()
    set_field(page, "chat-system", "Answer briefly.")
    page.find_element("css selector", "#keys-box summary").click()  # folded: no key needed
    set_field(page, "api-key", "not-a-real-key")  # typed, never stored
    assert ask(page, "first question") == "done"
    before = text_of(page, "#chat-log")
    stored = page.execute_script("return JSON.stringify(sessionStorage)")
    assert "first question" in stored and "Answer briefly." in stored
    assert "not-a-real-key" not in stored
    page.refresh()
    wait_for(page, "#chat-log .msg.assistant[data-state=done]")
    assert text_of(page, "#chat-log") == before
    assert page.find_element("id", "chat-system").get_attribute("value") == "Answer briefly."
    assert page.find_element("id", "api-key").get_attribute("value") == ""  # keys forgotten
    page.find_element("id", "chat-new").click()
    page.refresh()
    wait_for(page, f"#chat-model option[value='{CHAT}']")
    assert found(page, "#chat-log .msg") == []


def test_regenerate_edit_and_resend_and_copy(page: Any) -> None:
    set_field(page, "chat-max-tokens", "6")
    assert ask(page, "a question") == "done"
    before = answered(page)
    page.find_element("css selector", ".msg.assistant [data-action=regenerate]").click()
    assert until_answered(page, before) == "done"
    assert len(found(page, "#chat-log .msg")) == 2
    page.find_element("css selector", ".msg.user [data-action=edit]").click()
    editor = wait_for(page, ".msg.user.editing textarea")
    editor.clear()
    editor.send_keys("a better question")
    before = answered(page)
    page.find_element("css selector", ".msg.user.editing button[type=submit]").click()
    assert until_answered(page, before) == "done" and answers(page) == ["done"]
    assert text_of(page, ".msg.user .content") == "a better question"
    stored = page.execute_script("return sessionStorage.getItem('vlmserve-console-chat')")
    assert "a better question" in stored and '"a question"' not in stored
    page.find_element("css selector", ".msg.user [data-action=copy]").click()
    wait_until(page, lambda: text_of(page, "#chat-status") == "copied")
    copied = page.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], (e) => arguments[0](String(e)))"
    )
    assert copied == "a better question"


def test_the_models_page_charts_the_last_minutes_of_metrics(
    page: Any, server: ServerProcess, shots: Path
) -> None:
    tab(page, "models")
    wait_for(page, "figure.chart[data-chart=tokens] canvas")
    body = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 48}
    for _ in range(8):  # a short load over several readings (one each 2 s)
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        time.sleep(1)

    def points(chart: str) -> int:
        figure = found(page, f"figure.chart[data-chart={chart}]")
        return int(figure[0].get_attribute("data-points") or 0) if figure else 0

    wait_until(page, lambda: min(points(c) for c in ("tokens", "ttft", "load", "kv")) > 0)
    titles = [t.text for t in found(page, "figure.chart .u-title")]
    assert titles[:4] == [
        "Output tokens/s",
        "TTFT p50 / p90, s (last minute)",
        "Requests running / waiting",
        "KV cache usage, %",
    ]
    legend = text_of(page, "figure.chart[data-chart=ttft] .u-legend")
    assert f"{CHAT} p50" in legend and f"{CHAT} p90" in legend
    page.execute_script("document.getElementById('models-charts').scrollIntoView()")
    screenshot(page, shots / "console-models-charts.png")


def test_a_phone_gets_the_chat_first_and_the_keys_folded(page: Any, shots: Path) -> None:
    size = page.get_window_size()
    page.set_window_size(390, 844)
    try:
        page.refresh()
        wait_for(page, f"#chat-model option[value='{CHAT}']")
        set_field(page, "chat-max-tokens", "12")
        assert ask(page, "hello from a phone") == "done"
        keys = page.find_element("id", "keys-box").rect
        inner = page.execute_script("return window.innerHeight")
        assert keys["height"] < inner / 10
        log = page.find_element("id", "chat-log").rect
        settings = page.find_element("id", "chat-model").rect
        composer = page.find_element("id", "chat-input").rect
        assert log["y"] < composer["y"] < settings["y"]  # the chat first, settings below
        width = page.execute_script("return document.documentElement.scrollWidth")
        assert width <= page.execute_script("return window.innerWidth")
        screenshot(page, shots / "console-phone-chat.png")
    finally:
        page.set_window_size(size["width"], size["height"])


COLOUR = "return getComputedStyle(document.querySelector(arguments[0])).color"


def test_video_search_shows_only_failed_clips_in_the_error_colour(
    page: Any, tmp_path: Path
) -> None:
    tab(page, "search")
    page.find_element("id", "search-files").send_keys(clip(tmp_path / "clip.mp4", seed=1))
    wait_for(page, "#search-clips li[data-state=ready]")
    page.execute_script(
        """const error = document.createElement("p");
           error.className = "error";
           error.id = "colour-probe";
           document.body.append(error);
           const failed = document.createElement("li");
           failed.dataset.state = "failed";
           failed.innerHTML = '<span class="clip-state">failed: 400</span>';
           document.getElementById("search-clips").append(failed);"""
    )
    error = page.execute_script(COLOUR, "#colour-probe")
    ready = page.execute_script(COLOUR, "#search-clips li[data-state=ready] .clip-state")
    failed = page.execute_script(COLOUR, "#search-clips li[data-state=failed] .clip-state")
    assert ready != error and failed == error
