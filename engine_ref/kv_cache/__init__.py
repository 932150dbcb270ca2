"""The paged KV cache: per-layer specs, sizing, and the block pool."""
