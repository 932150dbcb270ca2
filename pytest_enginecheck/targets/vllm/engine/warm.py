"""Preloaded by the warm parent when an engine check runs, after ``describe.warm`` imported vLLM's ``LLM``: vLLM's
compiled helpers, compiled once here so the ranks forked below do not (``compiled``). Nothing is compiled
where the preload dropped ``LLM`` (its import tripped the CUDA guard or failed): then neither is vLLM imported here."""

from __future__ import annotations

import sys

from pytest_enginecheck.targets.vllm.engine.compiled import warm_compiled_helpers

COMPILED = "vllm.entrypoints.llm" in sys.modules and warm_compiled_helpers()
