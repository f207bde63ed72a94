"""Running vlmserve on a cluster scheduler (Ray Serve), beside the built-in gateway.

Nothing here is imported by the rest of vlmserve, and only ``deploy/ray.py``,
``deploy/replica.py``, ``deploy/ingress.py`` and ``deploy/backend.py`` import ``ray`` (the
``ray`` extra): ``deploy/config.py`` and ``deploy/wire.py`` are plain Python, so the settings
and the wire format are tested without Ray.
"""
