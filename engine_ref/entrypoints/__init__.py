"""User-facing entry points: the LLM class and the engine-ref command line."""
