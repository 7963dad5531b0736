"""``avatar-rtc serve --workers N``: N media worker processes behind one HTTP front.

Each worker (``child``) is the whole single-process server (``rtc_server.app``) on a unix
socket of its own, with its own models, aiortc peers and UDP ports: media and the data channel
go straight between caller and worker. The front (``front``) holds no models; it proxies HTTP
(``/offer`` to the least-loaded worker, a session's routes to the worker that holds it), merges
``/readyz`` and ``/metrics``, restarts workers that die (``pool``) and drains them all on
SIGTERM. Design notes: docs/DECISIONS.md, "Workers".
"""
