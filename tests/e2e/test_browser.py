"""A real browser on another origin streams a chat completion, then replays it with EventSource.

Debian's ``chromium`` runs headless, driven by Selenium through Debian's ``chromedriver`` (its
path is given, so Selenium Manager never runs and nothing is downloaded). The page comes from
one loopback origin and calls a real ``vlmserve serve`` on another, started with
``--cors-allow-origins`` for the page's origin. The browser is kept off every non-loopback
host (host resolver rules and a dead proxy). Skipped only where chromium or chromedriver are
missing: ``scripts/setup.sh`` installs them.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.selenium_manager import SeleniumManager

from support import ServerProcess

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM and CHROMEDRIVER),
        reason="chromium or chromedriver not found (scripts/setup.sh installs Debian's "
        "chromium and chromium-driver)",
    ),
]
LIMIT_S = 30

# Streams a chat completion with fetch(), then replays it with EventSource until the server's
# 204 to the automatic reconnect closes it; the outcome lands in window.result.
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>vlmserve browser test</title></head><body><script>
const params = new URLSearchParams(location.search);
const server = params.get("server");
const body = JSON.parse(params.get("body"));

function contentOf(data) {
  return JSON.parse(data).choices.map((c) => (c.delta && c.delta.content) || "").join("");
}

async function fetchStream() {
  const res = await fetch(server + "/v1/chat/completions", {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
  });
  const sid = res.headers.get("X-Session-ID");
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", text = "", done = false, ids = 0;
  while (!done) {
    const chunk = await reader.read();
    if (chunk.done) break;
    buffer += decoder.decode(chunk.value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\\n\\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\\n")) {
        if (line.startsWith("id:")) ids += 1;
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") done = true; else text += contentOf(data);
      }
    }
  }
  return {status: res.status, sid, text, ids};
}

function replay(sid) {
  return new Promise((resolve) => {
    const es = new EventSource(server + "/v1/streams/" + sid);
    const seen = {text: "", eventIds: [], done: 0, errors: 0, opened: 0};
    es.onopen = () => { seen.opened += 1; };
    es.onmessage = (e) => {
      seen.eventIds.push(e.lastEventId);
      if (e.data === "[DONE]") seen.done += 1; else seen.text += contentOf(e.data);
    };
    es.onerror = () => {
      seen.errors += 1;
      if (es.readyState === EventSource.CLOSED) resolve({...seen, readyState: es.readyState});
    };
  });
}

(async () => {
  try {
    const fetched = await fetchStream();
    const replayed = await replay(fetched.sid);
    window.result = {fetched, replayed};
  } catch (err) {
    window.result = {error: String(err)};
  }
})();
</script></body></html>
"""


# With API keys set: starts a stream with fetch() and the key (a page's backend would), then
# follows it with EventSource and the stream's resume token alone, as a browser must (it cannot
# send a key); the same token on another session, and no token at all, are refused.
TOKEN_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>vlmserve resume token test</title></head><body><script>
const params = new URLSearchParams(location.search);
const server = params.get("server"), key = params.get("key");
const body = JSON.parse(params.get("body"));

async function start() {
  const res = await fetch(server + "/v1/chat/completions", {method: "POST",
    headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key},
    body: JSON.stringify(body)});
  const text = await res.text();
  return {status: res.status, sid: res.headers.get("X-Session-ID"),
          token: res.headers.get("X-Resume-Token"), first: text.split("\\n\\n")[0]};
}

function follow(url) {
  return new Promise((resolve) => {
    const es = new EventSource(url);
    const seen = {data: [], eventIds: [], errors: 0, opened: 0};
    es.onopen = () => { seen.opened += 1; };
    es.onmessage = (e) => { seen.eventIds.push(e.lastEventId); seen.data.push(e.data); };
    es.onerror = () => {
      seen.errors += 1;
      if (es.readyState === EventSource.CLOSED) resolve({...seen, readyState: es.readyState});
    };
  });
}

(async () => {
  try {
    const one = await start(), two = await start();
    const withToken = (sid, token) =>
      `${server}/v1/streams/${sid}?token=${encodeURIComponent(token)}`;
    const own = await follow(withToken(one.sid, one.token));
    const other = await follow(withToken(two.sid, one.token));
    const none = await follow(`${server}/v1/streams/${one.sid}`);
    window.result = {one, two, own, other, none};
  } catch (err) {
    window.result = {error: String(err)};
  }
})();
</script></body></html>
"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        pages = {"/": PAGE, "/token": TOKEN_PAGE}
        page = pages.get(self.path.split("?")[0])
        found = page is not None
        payload = page.encode() if page is not None else b"not found"
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "text/html; charset=utf-8" if found else "text/plain")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def page_origin() -> Iterator[str]:
    """The page's own origin: a second loopback server (another port is another origin)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[webdriver.Chrome]:
    def no_selenium_manager(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Selenium Manager must not run: it would download a driver")

    monkeypatch.setattr(SeleniumManager, "binary_paths", no_selenium_manager)
    monkeypatch.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-default-apps",
        "--disable-domain-reliability",
        "--no-pings",
        "--disable-client-side-phishing-detection",
        "--metrics-recording-only",
        # loopback only: names other than 127.0.0.1 do not resolve, and whatever is not
        # loopback (an IP literal) goes to a proxy on a closed port
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--proxy-server=http://127.0.0.1:9",
        "--proxy-bypass-list=127.0.0.1",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # requested URLs
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(LIMIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def _requested_urls(driver: webdriver.Chrome) -> list[str]:
    """Every URL the browser requested (DevTools' performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def _statuses_5xx(log: str) -> list[str]:
    """5xx statuses in the access log lines (uvicorn's and vlmserve's)."""
    return re.findall(r'(?:HTTP/1\.1" |-> )(5\d\d)\b', log)


def test_page_on_another_origin_streams_then_replays_with_event_source(
    tiny_dir: Path, page_origin: str, browser: webdriver.Chrome
) -> None:
    server = ServerProcess(
        [
            "serve",
            "--model",
            str(tiny_dir),
            "--served-model-name",
            "tiny",
            "--device",
            "cpu",
            "--cors-allow-origins",
            page_origin,
        ],
    )
    ready_at, result, urls = 0, None, []
    try:
        server.wait_ready(timeout=120)
        ready_at = len(server.output())
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
        }
        query = urlencode({"server": server.url, "body": json.dumps(body)})
        started = time.monotonic()
        browser.get(f"{page_origin}/?{query}")
        while result is None and time.monotonic() - started < LIMIT_S:
            time.sleep(0.2)
            result = browser.execute_script("return window.result || null;")
        time.sleep(0.5)  # let the access log catch up with the 204
        urls = _requested_urls(browser)
    finally:
        log = server.stop()[ready_at:]  # after start-up: /ready is 503 until then
    assert result is not None, f"the page gave no result in {LIMIT_S} s; server log:\n{log}"
    assert "error" not in result, result
    fetched, replayed = result["fetched"], result["replayed"]
    sid = fetched["sid"]
    assert fetched["status"] == 200 and sid, "X-Session-ID not readable (expose it in CORS)"
    assert fetched["ids"] == 0, "the default wire is OpenAI's data-only lines"
    assert fetched["text"], "the stream carried no text"
    assert replayed["readyState"] == 2  # EventSource.CLOSED: the 204 ended it
    assert replayed["text"] == fetched["text"]
    assert replayed["done"] == 1 and replayed["opened"] == 1
    indexes = [int(i.rsplit(":", 1)[1]) for i in replayed["eventIds"] if i]
    assert all(i.startswith(f"{sid}:") for i in replayed["eventIds"] if i)
    assert indexes == sorted(set(indexes)) and indexes[0] == 0
    # EventSource's reconnect (Last-Event-ID at the end) got the 204 that closed it
    assert re.search(rf'GET /v1/streams/{sid}(?: HTTP/1\.1" | -> )204\b', log), log
    assert not _statuses_5xx(log), log
    assert f"{server.url}/v1/streams/{sid}" in urls
    network = [u for u in urls if urlsplit(u).scheme in ("http", "https", "ws", "wss")]
    assert {urlsplit(u).hostname for u in network} == {"127.0.0.1"}, network  # loopback only


def test_event_source_resumes_with_the_resume_token_when_api_keys_are_set(
    tiny_dir: Path, page_origin: str, browser: webdriver.Chrome
) -> None:
    server = ServerProcess(
        [
            "serve",
            "--model",
            str(tiny_dir),
            "--served-model-name",
            "tiny",
            "--device",
            "cpu",
            "--cors-allow-origins",
            page_origin,
            "--api-key",
            "page-key",
        ],
    )
    ready_at, result = 0, None
    try:
        server.wait_ready(timeout=120)
        ready_at = len(server.output())
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
        }
        query = urlencode({"server": server.url, "key": "page-key", "body": json.dumps(body)})
        started = time.monotonic()
        browser.get(f"{page_origin}/token?{query}")
        while result is None and time.monotonic() - started < LIMIT_S:
            time.sleep(0.2)
            result = browser.execute_script("return window.result || null;")
        time.sleep(0.5)  # let the access log catch up
    finally:
        log = server.stop()[ready_at:]
    assert result is not None, f"the page gave no result in {LIMIT_S} s; server log:\n{log}"
    assert "error" not in result, result
    one, own, other, none = result["one"], result["own"], result["other"], result["none"]
    assert one["status"] == 200 and one["token"], "X-Resume-Token not readable (CORS expose)"
    assert json.loads(one["first"].removeprefix("data: "))["resume_token"] == one["token"]
    assert own["opened"] == 1 and own["readyState"] == 2  # the 204 at the end closed it
    assert own["data"][-1] == "[DONE]" and "resume_token" not in own["data"][0]
    assert own["eventIds"][0] == f"{one['sid']}:0"
    for refused in (other, none):  # another session's token; no token (a 404; a 401)
        assert refused["opened"] == 0 and refused["data"] == [] and refused["readyState"] == 2
    assert re.search(rf"GET /v1/streams/{two_sid(result)}\?token=\*\*\*", log), log
    assert one["token"] not in log and not _statuses_5xx(log)


def two_sid(result: dict[str, Any]) -> str:
    return re.escape(result["two"]["sid"])
