"""KV connectors: moving KV blocks between this engine and something outside it.

The scheduler side (`base.py`, imported by `core`) says how many of a request's tokens an
external store holds and which blocks to load or save each step; the worker side
(`worker_base.py`, with tensors, imported by `worker` only) copies them. Connectors by
`kv_connector` name: `factory.py` (scheduler side), `worker_factory.py` (worker side).
"""
