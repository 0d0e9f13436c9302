"""The batch runner: `map()` / `imap()`, the order items start in, the JSONL store that makes a
batch resumable, and progress.

Private modules; the public names are exported by `dsclient` itself.
"""
