"""What the vLLM target is: vLLM's registry after its general plugins loaded, and the modules the warm parent preloads.

- ``plugins``: vLLM's general plugins, one entry point at a time under the CUDA guard (the target's PluginLoader).
- ``registry``: every architecture (string- or class-registered), imported and inspected under the guard.
- ``preload`` / ``warm``: the modules many model modules share, found from the target, preloaded in the warm parent.

Imports ``probe`` and the core only.
"""
