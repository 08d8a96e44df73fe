"""The messages that cross tokenserve's boundaries, as plain typed data.

- `engine_core.py`: API process ↔ engine core (requests in; outputs and scheduler stats out).
- `scheduler_output.py`: engine core → workers (what one step computes).
- `model_runner_output.py`: workers → engine core (what one step sampled).

A leaf package: it imports nothing of tokenserve but `sampling_params` (a leaf too), so
each side of a boundary depends on it and never on the other side
(`[tool.importlinter]` in pyproject.toml, tests/test_import_walls.py).
"""
