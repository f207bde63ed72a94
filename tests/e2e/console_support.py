"""Helpers for the web-console test: Debian's chromium under Selenium, a TCP proxy that cuts
one streamed answer after N bytes, the browser's request log, and small screenshots."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else shutil.which("chromium")
CHROMEDRIVER = "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
MISSING = (
    "needs Debian's chromium and chromium-driver: apt-get install chromium chromium-driver"
    if not (CHROMIUM and CHROMEDRIVER)
    else "needs selenium: pip install -e '.[dev]'"
    if importlib.util.find_spec("selenium") is None
    else None
)


class CuttingProxy:
    """Forwards 127.0.0.1:port to the server; once armed, the next connection that sends
    ``trigger`` gets its answer cut (both sockets closed) after ``after_bytes`` bytes."""

    def __init__(self, target_port: int, trigger: bytes = b"POST /v1/chat/completions"):
        self.target_port = target_port
        self.trigger = trigger
        self.after_bytes: int | None = None
        self.cuts = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, after_bytes: int) -> None:
        with self._lock:
            self.after_bytes = after_bytes

    def _take(self) -> int | None:
        with self._lock:
            taken, self.after_bytes = self.after_bytes, None
            return taken

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            link = {"budget": None}  # set when this connection sends the trigger while armed
            threading.Thread(target=self._up, args=(client, upstream, link), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, link), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, link: dict[str, Any]) -> None:
        tail = b""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                seen = tail + data
                if self.trigger in seen and link["budget"] is None:
                    link["budget"] = self._take()
                tail = seen[-len(self.trigger) :]
                dst.sendall(data)
        _close(dst)

    def _down(self, src: socket.socket, dst: socket.socket, link: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                budget = link["budget"]
                if budget is not None and len(data) >= budget:
                    dst.sendall(data[:budget])
                    self.cuts += 1
                    break
                if budget is not None:
                    link["budget"] = budget - len(data)
                dst.sendall(data)
        _close(dst)
        _close(src)

    def close(self) -> None:
        self._closing = True
        self._listener.close()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@contextlib.contextmanager
def chromium(width: int = 1280, height: int = 900) -> Iterator[Any]:
    """Headless chromium driven through ``/usr/bin/chromedriver`` (given explicitly, so
    selenium-manager never runs); names other than 127.0.0.1 do not resolve."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-default-apps",
        "--metrics-recording-only",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--autoplay-policy=no-user-gesture-required",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


class RequestLog:
    """Every URL the page requested (Chrome DevTools' performance log, drained as read)."""

    def __init__(self, driver: Any):
        self.driver = driver
        self.urls: list[str] = []

    def read(self) -> list[str]:
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                self.urls.append(message["params"]["request"]["url"])
            elif message["method"] == "Network.webSocketCreated":
                self.urls.append(message["params"]["url"])
        return self.urls

    def foreign(self, origins: tuple[str, ...]) -> list[str]:
        """Requested URLs outside ``origins`` other than ``data:`` and ``blob:``."""
        allowed = (*(f"{o}/" for o in origins), "data:", "blob:")
        return [u for u in self.read() if not u.startswith(allowed)]


def screenshot(driver: Any, path: Path, max_bytes: int = 200_000) -> Path:
    """A PNG of the page, quantised to a palette so that it stays small for the README."""
    from PIL import Image

    image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    for colors in (128, 64, 32):
        buf = io.BytesIO()
        image.quantize(colors=colors).save(buf, format="PNG", optimize=True)
        if buf.tell() < max_bytes:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return path
