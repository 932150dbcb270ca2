"""Memory accounting: exact bytes by category (weights, activation peak, KV cache)."""
