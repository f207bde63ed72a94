"""A streamed ``store: false`` response leaves nothing on disk: its prompt and events never
reach ``sessions.db`` (a stored one's do, which is what makes this test able to fail)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager


def on_disk(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())


async def test_a_streamed_unstored_response_writes_nothing_to_the_sessions_db(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    settings = make_settings(
        tiny_dir, persist_sessions=True, sessions_db_path=str(tmp_path / "sessions.db")
    )
    app = build_app(settings, models=chat_models)
    marks = {store: f"mark-{uuid.uuid4().hex}" for store in (False, True)}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for store, mark in marks.items():
                body = {
                    "model": MODEL,
                    "input": f"Repeat {mark}",
                    "max_output_tokens": 3,
                    "stream": True,
                    "store": store,
                }
                r = await http.post("/v1/responses", json=body)
                assert r.status_code == 200 and b"event: response.incomplete" in r.content
                rid = r.headers["x-session-id"]
                retrieved = await http.get(f"/v1/responses/{rid}")
                assert retrieved.status_code == (200 if store else 404)
                assert ("x-resume-token" in r.headers) is store  # nothing to resume otherwise
    await app.state.services.sessions.store.close()  # the journal copied into the database
    written = on_disk(tmp_path)
    assert marks[True].encode() in written
    assert marks[False].encode() not in written
