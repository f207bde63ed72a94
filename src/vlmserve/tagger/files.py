"""Which files get tagged, their identity (sha256), and how they travel (data URLs)."""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

__all__ = ["IMAGE_TYPES", "VIDEO_TYPES", "MediaFile", "encode_media", "find_media", "sha256_of"]

IMAGE_TYPES = {
    ".jpg": "image",
    ".jpeg": "image",
    ".png": "image",
    ".webp": "image",
    ".gif": "image",
    ".bmp": "image",
    ".tif": "image",
    ".tiff": "image",
}
VIDEO_TYPES = {
    ".mp4": "video/mp4",
    ".webm": "video/webm",
    ".mov": "video/quicktime",
    ".m4v": "video/mp4",
}
MAX_SIDE = 1024  # images are downscaled client-side: smaller uploads, same answers


@dataclass(slots=True, frozen=True)
class MediaFile:
    path: Path
    rel: str  # path relative to the tagged folder, with forward slashes
    kind: str  # "image" | "video"


def find_media(root: Path) -> list[MediaFile]:
    """Images and videos under ``root`` (recursive, hidden files and folders skipped), sorted."""
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        suffix = path.suffix.lower()
        if suffix in IMAGE_TYPES or suffix in VIDEO_TYPES:
            kind = "video" if suffix in VIDEO_TYPES else "image"
            found.append(MediaFile(path, rel.as_posix(), kind))
    return found


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _image_url(data: bytes) -> str:
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.draft("RGB", (MAX_SIDE, MAX_SIDE))  # JPEG: decode at reduced size, fast
            img.load()
            rgb = img.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError("not a readable image (unknown or corrupt format)") from None
    except Exception as exc:  # Pillow raises many types for broken files
        raise ValueError(f"not a readable image ({exc})") from exc
    rgb.thumbnail((MAX_SIDE, MAX_SIDE))
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def encode_media(media: MediaFile, data: bytes) -> dict[str, object]:
    """The chat content part for one file: a downscaled JPEG data URL, or the video as is."""
    if media.kind == "image":
        return {"type": "image_url", "image_url": {"url": _image_url(data)}}
    mime = VIDEO_TYPES[media.path.suffix.lower()]
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    return {"type": "video_url", "video_url": {"url": url}}
