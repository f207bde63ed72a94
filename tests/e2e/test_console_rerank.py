"""The console's video search with a rerank step, in a real browser against a real server that
holds an embedding model and a scripted reranker (it ranks by the word "dog": here, in the
clips' file names): the reranked list puts the dog clip first and shows its relevance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from console_support import MISSING, chromium, screenshot

from support import ServerProcess
from vlmserve.media.encode import encode_mp4
from vlmserve.testing import build_qwen2_vl
from vlmserve.testing.families.rerankers import build_qwen3_vl_reranker
from vlmserve.testing.media import gradient_image

pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

RERANKER = "tiny-reranker"
WAIT = 90
NAMES = ["red car.mp4", "my dog and a dog.mp4", "blue sky.mp4"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tiny = build_qwen2_vl()
    config = tmp_path_factory.mktemp("rerank") / "vlmserve.toml"
    config.write_text(
        f'device = "cpu"\n\n[[models]]\nname = "chat"\nsource = "{tiny}"\n\n'
        f'[[models]]\nname = "embed"\nsource = "{tiny}"\nroles = ["embedding"]\n\n'
        f'[[models]]\nname = "{RERANKER}"\nsource = "{build_qwen3_vl_reranker(scripted=True)}"\n'
        'roles = ["rerank"]\n'
    )
    proc = ServerProcess(["serve", "--config", str(config)])
    try:
        proc.wait_ready(timeout=240)
        yield proc
    finally:
        proc.stop()


def _wait(driver: Any, check: Any) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT, poll_frequency=0.1).until(lambda d: check())


def _found(driver: Any, css: str) -> list[Any]:
    return driver.find_elements("css selector", css)


def test_video_search_with_rerank_shows_the_reordered_list(
    server: ServerProcess, tmp_path: Path
) -> None:
    paths = []
    for i, name in enumerate(NAMES):
        frames = [gradient_image(64, 48, seed=i * 10 + j) for j in range(4)]
        (tmp_path / name).write_bytes(encode_mp4(frames, 64, 48, fps=4))
        paths.append(str(tmp_path / name))
    with chromium() as page:
        page.get(f"{server.url}/")
        _wait(page, lambda: _found(page, "body[data-models]"))
        page.find_element("id", "tab-search").click()
        _wait(page, lambda: _found(page, f"#search-reranker option[value='{RERANKER}']"))
        page.find_element("id", "search-files").send_keys("\n".join(paths))
        _wait(page, lambda: len(_found(page, "#search-clips li[data-state=ready]")) == 3)
        page.find_element("id", "search-query").send_keys("where is the pet")
        page.find_element("css selector", "#search-form button[type=submit]").click()
        rows = _wait(page, lambda: _found(page, "table.ranked tbody tr"))
        assert not _found(page, "table.reranked")  # cosine only until a reranker is picked
        from selenium.webdriver.support.ui import Select

        Select(page.find_element("id", "search-reranker")).select_by_value(RERANKER)
        page.find_element("css selector", "#search-form button[type=submit]").click()
        rows = _wait(page, lambda: _found(page, "table.reranked tbody tr"))
        names = [r.find_element("tag name", "figcaption").text for r in rows]
        assert len(rows) == 3 and names[0].endswith(NAMES[1]), names
        relevance = [float(r.find_elements("tag name", "td")[3].text) for r in rows]
        assert relevance == sorted(relevance, reverse=True)
        assert "reranked by" in page.find_element("css selector", "table.reranked caption").text
        screenshot(page, tmp_path / "console-search-rerank.png")
