"""The vLLM target's adapter: vLLM's registry, plugins and CPU engine, probed rather than pinned.

- ``probe``: what the installed vLLM offers (registry, ModelInfo builder, inspection subprocess,
  plugin loader, CPU backend).
- ``plugins``: vLLM's general plugins, one entry point at a time under the CUDA guard.
- ``registry``: every architecture (string- or class-registered), imported and inspected under the guard.
- ``preload``: the modules many model modules share, found from the target, to preload in the warm parent.
- ``checkpoints``: tiny HF checkpoints from transformers' config classes.
- ``engine`` / ``memory`` / ``failures``: vLLM's own engine on CPU ranks, its per-rank memory, its failures.
- ``checks``: the check functions (``run(ctx)``) the plugin's runner calls for ``--enginecheck-target=vllm``.

Importing this package imports neither torch nor vLLM.
"""

# The engine's own packages: strict mode does not blame a model for the CUDA queries made while they are imported
# (see guard.CudaGuard).
ENGINE_PACKAGES = ("vllm",)
