"""The executor: the engine core's one handle on the workers that run the model."""
