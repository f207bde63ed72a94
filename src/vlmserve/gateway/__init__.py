"""The gateway: replicas of proxied models, how workers join them, and their health.

``pool.py`` picks a replica per request (least outstanding, health, ejection);
``registration.py`` is the worker side (register on start, deregister on stop);
``replicas.py`` is the gateway side (register/deregister requests against the models).
"""
