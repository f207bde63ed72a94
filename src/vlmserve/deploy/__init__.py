"""Deprecated name of :mod:`vlmserve.ray_serve` (the Ray Serve application), kept for one
release so that ``RayService`` files naming ``vlmserve.deploy.ray:app`` keep working."""
