"""The bottom layer: request and sequence state, sampling parameters, the KV schema and
dtypes, and the typed messages between the front end and the engine.

Nothing here imports any other part of sage_infer (`tests/test_layering.py` checks it),
so every layer above can share these types without import cycles.
"""
