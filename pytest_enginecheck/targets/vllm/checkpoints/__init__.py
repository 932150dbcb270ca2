"""Tiny checkpoints of vLLM's architectures, made on disk once per session; this package starts no engine.

From the bottom up (each module imports only those above it in this list, and ``describe``):

- ``shrink``: the shrink rules (TINY_SIZES, VLLM_CONFIG_SIZES) and a text decoder's tiny config; NoTinyCheckpoint.
- ``reading``: what is read back from a written checkpoint (its vocabulary size).
- ``hub_layout``: a written checkpoint brought to the hub checkpoints' tensor names, norms and config fields.
- ``composite``, ``tokenizer``, ``remote_config``: composite (multimodal) configs, the checker's tiny tokenizer, the
  configuration module the checker writes where only remote code defines a config.
- ``args``: vLLM's arguments a checkpoint needs (each kind above says its own).
- ``vllm_build``: vLLM's model of a config-only checkpoint, built in this process.
- ``vllm_configs``, ``multimodal``: the config class vLLM parses a checkpoint with, and its multimodal composites.
- ``weight_layout``: vLLM's model's parameters as checkpoint tensors, and the proof that they round-trip.
- ``from_vllm``, ``from_transformers``: the two writers; ``tiny``: the factory that picks one and makes it once.
- ``quantized``: a checkpoint's pre-quantized and dequantized twins (compressed-tensors).
"""
