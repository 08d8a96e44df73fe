"""Structured outputs: the output follows a JSON schema, a regex, a choice or a grammar.

- `grammar.py`: the grammar engine (xgrammar): specs, validation, compiling, matchers.
- `manager.py`: the engine core's side: compile pool and cache, per-step bitmasks.
- `request.py`: one request's grammar state.
The user asks through `SamplingParams(structured_outputs=StructuredOutputsParams(...))`.
"""
