"""Ordering and limits: the governor (slots, lanes, urgency, groups), the closed-loop limit
controller, a server as an object (`Endpoint`), its load, its health, the shared budget in
Redis, and several servers: the pool and the router.

Private modules; the public names are exported by `dsclient` itself.
"""
