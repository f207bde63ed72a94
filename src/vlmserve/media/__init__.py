"""Media intake: read images and videos from URLs, data: URLs, base64 or allowed local paths
under a ``MediaPolicy`` (SSRF rules, byte, pixel, frame and time limits), then decode them.

    source ──▶ fetch.read_source (data:/base64/path/http(s) + netguard) ──▶ bytes
           ──▶ image.decode_image  -> RGB PIL image
           ──▶ video.decode_video  -> VideoFrames (the frames a family's rule picks,
                                      ``sampling.VideoSampling``)

No torch here; decoding runs in worker threads via ``load_image`` / ``load_video``.
"""

from vlmserve.media.fetch import read_source
from vlmserve.media.image import decode_image, load_image
from vlmserve.media.netguard import Resolver
from vlmserve.media.policy import MediaPolicy, VideoFrames
from vlmserve.media.video import decode_video, load_video

__all__ = [
    "MediaPolicy",
    "Resolver",
    "VideoFrames",
    "decode_image",
    "decode_video",
    "load_image",
    "load_video",
    "read_source",
]
