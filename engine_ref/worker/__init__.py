"""A worker runs one rank: device, process group, model, KV cache."""
