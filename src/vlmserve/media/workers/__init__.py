"""The media pipeline off the request path: decode in worker processes (``MediaPool``) and a
byte budget for media in flight (``MediaBudget``). No torch here."""

from vlmserve.media.workers.budget import Lease, MediaBudget, current_lease, hand_over
from vlmserve.media.workers.pool import MediaPool, default_workers
from vlmserve.media.workers.tasks import read_and_decode

__all__ = [
    "Lease",
    "MediaBudget",
    "MediaPool",
    "current_lease",
    "default_workers",
    "hand_over",
    "read_and_decode",
]
