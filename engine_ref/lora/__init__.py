"""LoRA (vLLM's design): adapters in PEFT's format, ``...WithLoRA`` layers, slots owned by a manager."""
