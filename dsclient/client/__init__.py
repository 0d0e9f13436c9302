"""The client side: `AsyncClient` and `Client`, planning a call, the request path
(attempts, retries, streams), discovery, token counting, and other SDKs over the client.

Private modules; the public names are exported by `dsclient` itself.
"""
