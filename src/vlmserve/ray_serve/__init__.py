"""Running vlmserve on a cluster scheduler (Ray Serve), beside the built-in gateway.

Nothing here is imported by the rest of vlmserve, and only ``ray_serve/app.py``,
``ray_serve/replica.py``, ``ray_serve/ingress.py`` and ``ray_serve/backend.py`` import ``ray`` (the
``ray`` extra): ``ray_serve/config.py`` and ``ray_serve/wire.py`` are plain Python, so the settings
and the wire format are tested without Ray.
"""
