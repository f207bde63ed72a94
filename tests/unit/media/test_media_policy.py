"""MediaPolicy defaults and validation; the package's public surface."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import vlmserve.media
from vlmserve.errors import ConfigError
from vlmserve.media import MediaPolicy, VideoFrames


def test_defaults_are_safe() -> None:
    policy = MediaPolicy()
    assert policy.allowed_local_roots == () and policy.allow_private_networks is False
    assert policy.max_bytes == 20 * 2**20 and policy.max_image_pixels == 4096 * 4096
    assert policy.max_video_frames == 32 and policy.max_redirects == 3


def test_policy_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        MediaPolicy().max_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "change",
    [{"max_bytes": 0}, {"max_video_frames": 0}, {"fetch_timeout": 0}, {"max_redirects": -1}],
)
def test_nonsense_limits_are_config_errors(change: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        MediaPolicy(**change)  # type: ignore[arg-type]


def test_video_frames_defaults_indices_to_empty() -> None:
    assert VideoFrames(frames=[], fps=None, source_frames=0).frame_indices == []


def test_public_surface() -> None:
    assert set(vlmserve.media.__all__) == {
        "MediaPolicy",
        "VideoFrames",
        "read_source",
        "decode_image",
        "load_image",
        "decode_video",
        "load_video",
        "Resolver",
    }


def test_importing_media_does_not_import_torch() -> None:
    code = "import sys, vlmserve.media; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
