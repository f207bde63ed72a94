"""Text before pictures: a text prompt queued behind a photo gets its first token in a step
that does not run the photo's vision tower; the photo follows in the next step. Bounded (a
photo is passed over at most ``MEDIA_DEFERRALS`` times), by priority (batch text does not
pass an interactive photo), never past a preempted row, and never at the cost of an idle
step. The scheduler's cases use real ``Sequence`` rows whose prepared input only carries a
prompt length; the last test runs the tiny Qwen2-VL engine.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

from tests.unit.engine.core.test_batching import drain, make_backend, request, wait_for

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.core.scheduler import MEDIA_DEFERRALS, Scheduler
from vlmserve.engine.core.sequence import Sequence
from vlmserve.engine.types import BATCH_PRIORITY, INTERACTIVE_PRIORITY


def row(media: bool, priority: int = INTERACTIVE_PRIORITY, prompt_tokens: int = 4) -> Sequence:
    prepared = SimpleNamespace(prompt_tokens=prompt_tokens)
    return Sequence(prepared, None, None, 8, priority=priority, media=media)  # type: ignore[arg-type]


def queue(scheduler: Scheduler, *rows: Sequence) -> None:
    for r in rows:
        scheduler.add(r)


def test_text_queued_behind_a_photo_is_admitted_first_and_the_photo_next_step() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    photo, text, other = row(True), row(False), row(False)
    queue(scheduler, photo, text, other)
    assert scheduler.schedule() == [text, other]
    assert list(scheduler.waiting) == [photo] and photo.deferred == 1
    assert scheduler.schedule() == [photo]
    assert photo.deferred == 1


def test_photos_alone_and_text_alone_are_first_come_first_served() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    photos = [row(True) for _ in range(3)]
    queue(scheduler, *photos)
    assert scheduler.schedule() == photos
    assert [p.deferred for p in photos] == [0, 0, 0]
    texts = [row(False) for _ in range(3)]
    queue(scheduler, *texts)
    assert scheduler.schedule() == texts


def test_photos_keep_their_order_among_themselves_after_waiting() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    first, text, second = row(True), row(False), row(True)
    queue(scheduler, first, text, second)
    assert scheduler.schedule() == [text]
    assert scheduler.schedule() == [first, second]


def test_batch_text_does_not_pass_an_interactive_photo() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    photo, line = row(True), row(False, BATCH_PRIORITY)
    queue(scheduler, photo, line)
    assert scheduler.schedule() == [photo, line]
    assert photo.deferred == 0


def test_batch_text_waits_behind_an_interactive_photo_that_interactive_text_passes() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    photo, line, text = row(True), row(False, BATCH_PRIORITY), row(False)
    queue(scheduler, photo, line, text)
    assert list(scheduler.waiting) == [photo, text, line]
    assert scheduler.schedule() == [text]  # the batch line keeps its place behind the photo
    assert scheduler.schedule() == [photo, line]


def test_only_photos_of_the_texts_priority_or_a_worse_one_wait_for_it() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    photo, batch_photo, line = row(True), row(True, BATCH_PRIORITY), row(False, BATCH_PRIORITY)
    queue(scheduler, photo, batch_photo, line)
    assert scheduler.schedule() == [photo, line]  # the interactive photo is not held back
    assert scheduler.schedule() == [batch_photo]


def test_batch_text_stays_behind_every_interactive_photo_passed_over() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    photo, text = row(True), row(False)
    batch_photo, line = row(True, BATCH_PRIORITY), row(False, BATCH_PRIORITY)
    queue(scheduler, photo, text, batch_photo, line)
    assert list(scheduler.waiting) == [photo, text, batch_photo, line]
    assert scheduler.schedule() == [text]  # the line is behind the interactive photo
    assert scheduler.schedule() == [photo, line]
    assert scheduler.schedule() == [batch_photo]


def test_interactive_text_passes_a_batch_photo() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    photo, text = row(True, BATCH_PRIORITY), row(False)
    queue(scheduler, photo, text)  # interactive text is queued ahead of batch work anyway
    assert scheduler.schedule() == [text]
    assert scheduler.schedule() == [photo]


def test_a_photo_waits_at_most_media_deferrals_steps_for_text() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    photo = row(True)
    queue(scheduler, photo)
    for step in range(MEDIA_DEFERRALS):
        text = row(False)
        scheduler.add(text)
        assert scheduler.schedule() == [text], step
        assert photo.deferred == step + 1
    text = row(False)
    scheduler.add(text)
    assert scheduler.schedule() == [photo, text]  # its turn: in order, with the text


def test_a_preempted_photo_is_never_passed_over() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    photo = row(True)
    queue(scheduler, photo)
    assert scheduler.schedule() == [photo]
    scheduler.preempt(photo)
    text = row(False)
    scheduler.add(text)
    assert scheduler.schedule() == [photo, text]
    assert photo.deferred == 0


def test_a_photo_goes_ahead_when_the_text_behind_it_does_not_fit_now() -> None:
    # 5 usable blocks of 16 tokens: the running row holds 2, the photo needs 1 and the text
    # 3, each plus 1 spare for the running row: only the photo fits, so it goes after all.
    blocks = BlockManager(num_blocks=6, block_size=16)
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=200, blocks=blocks)
    running = row(False, prompt_tokens=32)
    queue(scheduler, running)
    assert scheduler.schedule() == [running]
    photo, text = row(True, prompt_tokens=8), row(False, prompt_tokens=40)
    queue(scheduler, photo, text)
    assert scheduler.schedule() == [photo]
    assert photo.deferred == 0 and list(scheduler.waiting) == [text]


def test_text_passes_a_photo_within_the_steps_token_budget() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=10)
    photo = row(True, prompt_tokens=8)
    short, long = row(False, prompt_tokens=6), row(False, prompt_tokens=6)
    queue(scheduler, photo, short, long)
    assert scheduler.schedule() == [short]  # the second text would pass the budget
    assert scheduler.schedule() == [long]
    assert scheduler.schedule() == [photo]
    assert photo.deferred == 2


async def test_the_engine_gives_text_its_first_token_before_the_photo_queued_ahead(
    tiny_dir: Path,
) -> None:
    backend = make_backend(tiny_dir, max_num_seqs=8)
    try:
        engine = backend.engine
        assert engine is not None
        photo = await backend.prepare(request("Describe it.", image=(112, 84), max_tokens=2))
        text = await backend.prepare(request("Say hello.", max_tokens=2))
        steps: list[list[Sequence]] = []
        schedule = engine.scheduler.schedule

        def recording(used: int = 0) -> list[Sequence]:
            admitted = schedule(used)
            if admitted:
                steps.append(admitted)
            return admitted

        engine.scheduler.schedule = recording  # type: ignore[method-assign]
        entered, gate = threading.Event(), threading.Event()

        def hold() -> None:
            entered.set()
            gate.wait()

        held = engine.call(hold)  # the engine thread waits: both requests queue up
        await wait_for(entered.is_set)
        tasks = []
        for queued, prepared in enumerate((photo, text), start=1):  # the photo first
            tasks.append(asyncio.create_task(drain(backend, prepared)))
            await wait_for(lambda n=queued: engine.gauges.queued == n)
        gate.set()
        await asyncio.wrap_future(held)
        outcomes = await asyncio.gather(*tasks)
        assert [len(o.tokens) for o in outcomes] == [2, 2]
        assert [[s.prepared for s in admitted] for admitted in steps] == [[text], [photo]]
        assert [s.media for admitted in steps for s in admitted] == [False, True]
    finally:
        backend.close()
