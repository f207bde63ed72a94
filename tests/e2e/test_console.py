"""The web console at ``/`` in a real browser (Debian's chromium under Selenium) against a
real ``vlmserve demo`` with API and admin keys: chat with an image, a stream cut by a proxy
and resumed by the page, stop, video search over three clips, ID-card extraction, model
deactivate / activate. No request may leave the loopback origins. Screenshots go to
``$VLMSERVE_CONSOLE_SCREENSHOTS`` (the README's docs/img) or a temporary folder."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_support import MISSING, CuttingProxy, RequestLog, chromium, screenshot

from support import ServerProcess
from vlmserve.media.encode import encode_mp4
from vlmserve.testing.media import gradient_image, image_bytes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

API_KEY = "console-api-key"
ADMIN_KEY = "console-admin-key"
CHAT = "tiny-qwen2-vl"
EMBED = "tiny-vlm2vec"
WAIT = 60


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    env = {"VLMSERVE_API_KEYS": f'["{API_KEY}"]', "VLMSERVE_ADMIN_KEYS": f'["{ADMIN_KEY}"]'}
    proc = ServerProcess(["demo"], env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def proxy(server: ServerProcess) -> Iterator[CuttingProxy]:
    p = CuttingProxy(server.port)
    yield p
    p.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def requests_seen(browser: Any) -> RequestLog:
    return RequestLog(browser)


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("VLMSERVE_CONSOLE_SCREENSHOTS")
    return Path(given) if given else tmp_path_factory.mktemp("console-shots")


@pytest.fixture
def page(
    browser: Any, proxy: CuttingProxy, server: ServerProcess, requests_seen: RequestLog
) -> Iterator[Any]:
    """The console opened through the proxy with both keys typed in; afterwards, every
    request the page made must have gone to the server or the proxy."""
    browser.get(f"{proxy.url}/")
    browser.execute_script("sessionStorage.clear()")  # a conversation kept from another test
    browser.refresh()
    wait_for(browser, "body[data-models]")
    browser.find_element("id", "api-key").send_keys(API_KEY)
    browser.find_element("id", "admin-key").send_keys(ADMIN_KEY)
    browser.find_element("css selector", "#keys-form button[type=submit]").click()
    wait_for(browser, f"#chat-model option[value='{CHAT}']")
    yield browser
    assert requests_seen.foreign((proxy.url, server.url)) == []
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not [e for e in severe if "Content Security Policy" in e["message"]], severe


def wait_for(driver: Any, css: str, timeout: float = WAIT) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: d.find_element("css selector", css))


def wait_until(driver: Any, check: Any, timeout: float = WAIT) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: check())


def found(driver: Any, css: str) -> list[Any]:
    return driver.find_elements("css selector", css)


def text_of(driver: Any, css: str) -> str:
    return driver.execute_script("return document.querySelector(arguments[0]).textContent", css)


def tab(driver: Any, name: str) -> None:
    driver.find_element("id", f"tab-{name}").click()
    wait_for(driver, f"#page-{name}:not([hidden])")


def set_field(driver: Any, element_id: str, value: str) -> None:
    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_chat_streams_an_image_answer_and_resumes_after_a_dropped_connection(
    page: Any, proxy: CuttingProxy, server: ServerProcess, tmp_path: Path, shots: Path
) -> None:
    png = image_bytes(64, 64, seed=3)
    set_field(page, "chat-max-tokens", "40")
    set_field(page, "chat-temperature", "0")
    page.find_element("id", "chat-files").send_keys(write(tmp_path / "photo.png", png))
    wait_for(page, "#chat-attachments .thumb img")
    page.find_element("id", "chat-input").send_keys("What is in this image?")
    proxy.arm(after_bytes=1500)  # headers and a few events, then the connection drops
    page.find_element("id", "chat-send").click()
    answer = wait_for(page, ".msg.assistant:not([data-state=streaming])")
    assert answer.get_attribute("data-state") == "done", answer.text
    assert proxy.cuts == 1
    assert answer.get_attribute("data-resumed") == "1"
    meta = text_of(page, ".msg.assistant .meta")
    assert "resumed after a dropped connection" in meta
    assert "TTFT" in meta and "40 completion tokens" in meta
    screenshot(page, shots / "console-chat.png")

    image = {"url": "data:image/png;base64," + base64.b64encode(png).decode()}
    content = [
        {"type": "image_url", "image_url": image},
        {"type": "text", "text": "What is in this image?"},
    ]
    body = {
        "model": CHAT,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 40,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    greedy = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    expected = greedy.json()["choices"][0]["message"]["content"]
    kept = "return JSON.parse(sessionStorage.getItem('vlmserve-console-chat')).turns[1].text"
    assert page.execute_script(kept) == expected  # shown as Markdown, kept as it came


def test_stop_cancels_a_long_answer(page: Any) -> None:
    set_field(page, "chat-max-tokens", "4000")
    set_field(page, "chat-temperature", "0")
    page.find_element("id", "chat-input").send_keys("hi")
    page.find_element("id", "chat-send").click()
    wait_until(page, lambda: len(text_of(page, ".msg.assistant .content")) > 20)
    # Clicked by script: the streaming answer moves the layout under the pointer, so a
    # pointer click at the button's old position could land on the answer instead (seen in CI
    # as an intercepted click, or as a click lost and the answer running to its end).
    page.execute_script("arguments[0].click()", page.find_element("id", "chat-stop"))
    answer = wait_for(page, ".msg.assistant:not([data-state=streaming])", timeout=30)
    assert answer.get_attribute("data-state") == "cancelled"
    assert "stopped" in text_of(page, ".msg.assistant .meta")
    assert page.find_element("id", "chat-send").is_enabled()


# Replaces the page's fetch() for chat completions with a canned SSE body cut into 7-byte
# pieces (CRLF line ends too): the parser, reasoning and error events without a reasoning model.
FAKE_STREAM = """
const [events] = arguments;
const original = window.fetch;
window.fetch = async (input, init) => {
  if (!String(input).endsWith("/v1/chat/completions")) return original(input, init);
  const text = events.join("");
  const bytes = new TextEncoder().encode(text);
  const body = new ReadableStream({
    start(controller) {
      for (let i = 0; i < bytes.length; i += 7) controller.enqueue(bytes.slice(i, i + 7));
      controller.close();
    },
  });
  const headers = { "Content-Type": "text/event-stream", "X-Session-ID": "fake" };
  return new Response(body, { status: 200, headers });
};
"""


def sse(index: int, data: Any, event: str | None = None, end: str = "\n") -> str:
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}{end}" if event else ""
    return f"id: fake:{index}{end}{head}data: {payload}{end}{end}"


def delta(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def test_reasoning_is_folded_and_error_events_are_shown(page: Any) -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    events = [
        ": keep-alive comment\n\n",
        sse(0, delta(role="assistant", content="")),
        sse(1, delta(reasoning_content="think ")),
        sse(2, delta(reasoning="harder"), end="\r\n"),
        sse(3, delta(content="Ans")),
        sse(4, delta(content="wer")),
        sse(5, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        sse(6, {"choices": [], "usage": usage}),
        sse(7, "[DONE]"),
    ]
    page.execute_script(FAKE_STREAM, events)
    page.find_element("id", "chat-input").send_keys("think first")
    page.find_element("id", "chat-send").click()
    wait_for(page, ".msg.assistant[data-state=done]")
    reasoning = page.find_element("css selector", ".msg.assistant details.reasoning")
    assert reasoning.is_displayed() and reasoning.get_attribute("open") is None  # folded
    assert text_of(page, ".msg.assistant .reasoning-text") == "think harder"
    assert text_of(page, ".msg.assistant .content").strip() == "Answer"  # as Markdown: <p>
    assert "3 prompt + 2 completion tokens" in text_of(page, ".msg.assistant .meta")

    error = {"error": {"message": "model fell over"}}
    failing = [sse(0, delta(content="x")), sse(1, error, event="error"), sse(2, "[DONE]")]
    page.find_element("id", "chat-new").click()
    page.execute_script(FAKE_STREAM, failing)
    page.find_element("id", "chat-input").send_keys("again")
    page.find_element("id", "chat-send").click()
    answer = wait_for(page, ".msg.assistant:not([data-state=streaming])")
    assert answer.get_attribute("data-state") == "error"
    assert text_of(page, ".msg.assistant .error") == "model fell over"


def clip(path: Path, seed: int) -> str:
    frames = [gradient_image(64, 48, seed=seed * 10 + i) for i in range(4)]
    return write(path, encode_mp4(frames, 64, 48, fps=4))


def test_video_search_ranks_three_clips(page: Any, tmp_path: Path, shots: Path) -> None:
    tab(page, "search")
    paths = [clip(tmp_path / f"clip{i}.mp4", seed=i) for i in range(3)]
    page.find_element("id", "search-files").send_keys("\n".join(paths))
    wait_until(page, lambda: len(found(page, "#search-clips li[data-state=ready]")) == 3)
    page.find_element("id", "search-query").send_keys("a red car at night")
    page.find_element("css selector", "#search-form button[type=submit]").click()
    rows = wait_until(page, lambda: found(page, "table.ranked tbody tr"))
    assert len(rows) == 3
    scores = [float(r.find_elements("tag name", "td")[2].text) for r in rows]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1 for s in scores)
    assert {r.find_element("tag name", "figcaption").text.split()[-1] for r in rows} == {
        f"clip{i}.mp4" for i in range(3)
    }
    screenshot(page, shots / "console-search.png")


def test_id_card_extraction_shows_the_fields_with_their_checks(
    page: Any, tmp_path: Path, shots: Path
) -> None:
    tab(page, "extract")
    card = write(tmp_path / "ktp.jpg", image_bytes(96, 64, "JPEG"))
    page.find_element("id", "extract-file").send_keys(card)
    wait_for(page, "#extract-preview .thumb img")
    page.find_element("id", "extract-run").click()
    wait_for(page, "#extract-output[data-state=done], #extract-output[data-state=error]")
    state = page.find_element("id", "extract-output").get_attribute("data-state")
    assert state == "done", text_of(page, "#extract-status")
    fields = {r.get_attribute("data-field") for r in found(page, "table.fields tbody tr")}
    assert {"nik", "nama", "tgl_lahir", "alamat.rt_rw", "berlaku_hingga"} <= fields
    assert found(page, "table.fields .flag")
    assert '"validation"' in text_of(page, "#extract-output details.raw pre")
    screenshot(page, shots / "console-extract.png")


def test_models_page_deactivates_and_activates_the_chat_model(
    page: Any, server: ServerProcess, shots: Path
) -> None:
    body = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {API_KEY}"}  # tokens for the live tokens/s column
    httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    tab(page, "models")
    row = f"table.models tr[data-model='{CHAT}']"
    wait_for(page, f"{row}[data-state=ready]")
    assert found(page, f"table.models tr[data-model='{EMBED}']")
    page.find_element("css selector", f"button[aria-label='Deactivate {CHAT}']").click()
    wait_for(page, f"{row}[data-state=unloaded]")
    screenshot(page, shots / "console-models.png")
    page.find_element("css selector", f"button[aria-label='Activate {CHAT}']").click()
    wait_for(page, f"{row}[data-state=ready]")
    assert "tok/s" in text_of(page, row)
    size = page.get_window_size()
    page.set_window_size(390, 844)  # a phone: the table scrolls sideways, nothing overflows
    try:
        width = page.execute_script("return document.documentElement.scrollWidth")
        assert width <= page.execute_script("return window.innerWidth")
        screenshot(page, shots / "console-phone.png")
    finally:
        page.set_window_size(size["width"], size["height"])


def test_tabs_work_from_the_keyboard_and_keys_stay_in_memory(page: Any) -> None:
    from selenium.webdriver.common.keys import Keys

    page.find_element("id", "tab-chat").click()
    page.switch_to.active_element.send_keys(Keys.ARROW_RIGHT)
    assert page.switch_to.active_element.get_attribute("id") == "tab-search"
    assert page.find_element("id", "page-search").is_displayed()
    page.switch_to.active_element.send_keys(Keys.END)
    assert page.find_element("id", "tab-models").get_attribute("aria-selected") == "true"
    stored = "return [localStorage.length, JSON.stringify(sessionStorage), document.cookie]"
    local, session, cookie = page.execute_script(stored)
    assert local == 0 and cookie == "" and API_KEY not in session and ADMIN_KEY not in session
    page.refresh()  # a reload forgets the keys
    wait_for(page, "body[data-models=error]")
    assert "needs an API key" in text_of(page, "#global-status")


def test_console_files_are_public_and_carry_a_strict_csp(server: ServerProcess) -> None:
    index = httpx.get(f"{server.url}/")
    assert index.status_code == 200 and "text/html" in index.headers["content-type"]
    csp = index.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    script = httpx.get(f"{server.url}/ui/app.js")
    assert script.status_code == 200 and script.headers["content-security-policy"] == csp
    assert "<script>" not in index.text and " style=" not in index.text  # nothing inline
    assert httpx.get(f"{server.url}/ui/console.css").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the API still needs a key
