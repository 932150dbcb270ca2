"""Qwen2: Llama with biases on q, k and v (not o), usually with tied embeddings (Qwen2-0.5B)."""

from __future__ import annotations

from typing import ClassVar

from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    qkv_bias = True
    o_bias = False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Equal to transformers' Qwen2ForCausalLM."""

    decoder_layer_cls = Qwen2DecoderLayer
    reference_config: ClassVar[str] = "Qwen2-7B.json"
    # One KV head for four query heads: at TP=2 every rank holds a replica of it (Llama's 2 are split), the path
    # where KV-head shard selection and per-rank sizes go wrong.
    example_config: ClassVar[dict] = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "float32",
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": True,
        "use_sliding_window": False, "bos_token_id": 1, "eos_token_id": 2,
    }
