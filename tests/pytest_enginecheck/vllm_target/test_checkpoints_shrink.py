"""The tiny-config shrinking rules (checkpoints.shrink; ``tiny_config`` itself, which needs vLLM's model classes,
is the vllm tier's), and the tiny-checkpoint factory's refusal, kept once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# --- checkpoints: the tiny-config shrinking rules -------------------------------------------------------------

def test_tiny_sizes_shrink_only_the_fields_a_config_has() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_SIZES, tiny_sizes

    sizes = tiny_sizes({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128, "rope_theta": 1e6})
    assert sizes == {"hidden_size": 64, "num_attention_heads": 2, "head_dim": 64}
    # a model that derives the head size as hidden_size // heads builds another model than the config's
    assert sizes["hidden_size"] // sizes["num_attention_heads"] != sizes["head_dim"]
    assert TINY_SIZES["hidden_size"] // TINY_SIZES["num_attention_heads"] >= 32  # what a config without head_dim
    assert TINY_SIZES["head_dim"] >= 32  # derives, and the head: vLLM's CPU attention rejects head_dim 16
    assert TINY_SIZES["num_key_value_heads"] < TINY_SIZES["num_attention_heads"]  # GQA


def test_tiny_sizes_keep_a_top1_router_top1_and_make_every_layer_full_attention() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_sizes

    top1 = tiny_sizes({"num_local_experts": 16, "num_experts_per_tok": 1})
    assert top1 == {"num_local_experts": 4, "num_experts_per_tok": 1}
    assert tiny_sizes({"num_experts": 64, "num_experts_per_tok": 8})["num_experts_per_tok"] == 2
    assert tiny_sizes({"num_experts_per_tok": None}) == {"num_experts_per_tok": 2}
    layered = tiny_sizes({"num_hidden_layers": 40, "layer_types": ["sliding_attention"] * 40})
    assert layered == {"num_hidden_layers": 2, "layer_types": ["full_attention", "full_attention"]}


def test_a_family_with_a_sliding_window_keeps_one_shorter_than_the_prompts_on_its_sliding_layers() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_WINDOW, tiny_sizes

    gemma2 = tiny_sizes({"num_hidden_layers": 26, "sliding_window": 4096,
                         "layer_types": ["sliding_attention", "full_attention"] * 13})
    assert gemma2 == {"num_hidden_layers": 2, "sliding_window": TINY_WINDOW,
                      "layer_types": ["sliding_attention", "full_attention"]}
    assert TINY_WINDOW < 29  # the vLLM load check's shortest prompt: the window cuts into every one
    mistral = tiny_sizes({"sliding_window": 4096})  # one window for every layer, no layer_types
    assert mistral == {"sliding_window": TINY_WINDOW}
    # no window by default, or one its switch turns off (Qwen2's use_sliding_window: False): none, every layer full
    qwen2 = tiny_sizes({"num_hidden_layers": 28, "sliding_window": 4096, "use_sliding_window": False,
                        "layer_types": ["full_attention"] * 28})
    assert qwen2 == {"num_hidden_layers": 2, "sliding_window": None, "layer_types": ["full_attention"] * 2}
    assert tiny_sizes({"sliding_window": None}) == {"sliding_window": None}
    assert tiny_sizes({"sliding_window": 0}) == {"sliding_window": None}  # 0: vLLM's "no window" too


def test_a_family_whose_published_configs_scale_rope_gets_its_scaling() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import family_rope_parameters

    llama = family_rope_parameters("llama", {"rope_theta": 10000.0, "rope_type": "default"})
    assert llama == {"rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    gemma3 = family_rope_parameters("gemma3_text", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    assert gemma3 == {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},  # the local layers' unscaled
                      "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}
    assert family_rope_parameters("qwen2", {"rope_theta": 1e6, "rope_type": "default"}) is None  # its default stays
    assert family_rope_parameters("llama", None) is None


def test_the_tiny_llama_and_gemma2_configs_keep_their_familys_features() -> None:
    """The rules on transformers' own config classes: Llama's head_dim beside hidden/heads, GQA and llama3 scaling;
    Gemma 2's window on its sliding layer, which transformers' Gemma 2 needs to run at all."""
    import transformers

    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_WINDOW, tiny_text_config

    llama = tiny_text_config(transformers.LlamaConfig, transformers.LlamaConfig())
    assert (llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (64, 2, 1, 64)
    assert llama.rope_parameters["rope_type"] == "llama3"
    gemma2 = tiny_text_config(transformers.Gemma2Config, transformers.Gemma2Config())
    assert gemma2.sliding_window == TINY_WINDOW
    assert gemma2.layer_types == ["sliding_attention", "full_attention"]


def test_grouped_expert_routing_left_none_gets_one_group_and_a_set_one_is_kept() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_sizes

    assert tiny_sizes({"n_group": None, "topk_group": None}) == {"n_group": 1, "topk_group": 1}
    assert "n_group" not in tiny_sizes({"n_group": 8, "topk_group": 4})


def test_grouped_routing_over_tiny_experts_keeps_groups_that_hold_experts() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_GROUPS, TINY_SIZES, tiny_sizes

    sizes = tiny_sizes({"num_local_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4})
    assert sizes["n_group"] == TINY_GROUPS["n_group"] and sizes["topk_group"] == TINY_GROUPS["topk_group"]
    per_group = TINY_SIZES["num_local_experts"] // sizes["n_group"]
    assert TINY_SIZES["num_local_experts"] % sizes["n_group"] == 0
    assert sizes["topk_group"] * per_group >= sizes["num_experts_per_tok"]  # the chosen groups hold the top-k


def test_a_dense_layer_count_leaves_one_moe_layer_and_rotary_dim_keeps_its_share_of_the_head() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_sizes

    assert tiny_sizes({"num_hidden_layers": 24, "num_dense_layers": 2})["num_dense_layers"] == 1  # Lfm2-MoE
    assert "num_dense_layers" not in tiny_sizes({"num_hidden_layers": 24, "num_dense_layers": 1})  # kept: 1 of 2
    assert "first_k_dense_replace" not in tiny_sizes({"num_hidden_layers": 61, "first_k_dense_replace": 3})
    gptj = tiny_sizes({"hidden_size": 4096, "num_attention_heads": 16, "rotary_dim": 64})  # 64 of a 256 head
    assert gptj["rotary_dim"] == 8 and 0 < gptj["rotary_dim"] <= 64 // 2  # a quarter of the tiny head (32)
    full = tiny_sizes({"hidden_size": 4096, "num_attention_heads": 16, "head_dim": 128, "rotary_dim": 128})
    assert full["rotary_dim"] == full["head_dim"]


# --- checkpoints: the shrink rules for strict configs (transformers' validators are the checker's limit) -----------

def test_a_hybrid_layout_keeps_one_layer_of_each_kind_and_attention_becomes_full() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_layout

    olmo_hybrid = ["linear_attention"] * 3 + ["full_attention"]
    assert tiny_layout(olmo_hybrid * 8, 2) == {"num_hidden_layers": 2,
                                               "layer_types": ["linear_attention", "full_attention"]}
    zamba2 = ["linear_attention"] * 5 + ["hybrid"] + ["sliding_attention"]
    assert tiny_layout(zamba2, 2) == {"num_hidden_layers": 3,
                                      "layer_types": ["linear_attention", "hybrid", "full_attention"]}
    assert tiny_layout(["sliding_attention"] * 40, 2)["layer_types"] == ["full_attention", "full_attention"]
    assert tiny_layout([], 2)["layer_types"] == ["full_attention", "full_attention"]


def test_mamba2_heads_follow_hidden_size_times_expand_and_its_groups_divide_them() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_sizes

    sizes = tiny_sizes({"hidden_size": 4096, "head_dim": 64, "num_heads": 128, "expand": 2, "n_groups": 8})
    assert sizes["hidden_size"] * 2 == sizes["num_heads"] * sizes["head_dim"]
    assert sizes["num_heads"] % sizes["n_groups"] == 0 and sizes["n_groups"] == 2
    assert "num_heads" not in tiny_sizes({"hidden_size": 4096, "head_dim": 64, "num_heads": 32})  # attention heads


def test_a_read_only_property_is_never_set_and_an_int_field_keeps_its_default_instead_of_none() -> None:
    import dataclasses

    from pytest_enginecheck.targets.vllm.checkpoints.shrink import _admits_none, _read_only

    @dataclasses.dataclass
    class StrictConfig:
        sliding_window: int = 512
        pad_token_id: int | None = 0

        @property
        def head_dim(self) -> int:
            return 32

    class LegacyConfig:
        sliding_window = 4096

    assert _read_only(StrictConfig, "head_dim") and not _read_only(StrictConfig, "sliding_window")
    assert not _admits_none(StrictConfig, "sliding_window") and _admits_none(StrictConfig, "pad_token_id")
    assert _admits_none(LegacyConfig, "sliding_window") and _admits_none(StrictConfig, "no_such_field")


# --- tiny: the factory's refusal, kept beside the checkpoints ------------------------------------------------------

class _MultimodalModel:
    """Stands for a vLLM model class transformers has no class for: multimodal, so no vLLM-side checkpoint."""

    supports_multimodal = True


def test_a_refused_tiny_checkpoint_is_refused_once_per_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason is kept beside the checkpoints: the session's other items skip with it, without trying again."""
    from pytest_enginecheck.targets.vllm.checkpoints import tiny

    with pytest.raises(tiny.NoTinyCheckpoint, match="is multimodal") as first:
        tiny.tiny_checkpoint("EctpNoClassMultimodalModel", str(tmp_path), _MultimodalModel)
    assert "has no class 'EctpNoClassMultimodalModel'" in str(first.value)

    def again(*args: Any) -> None:
        raise AssertionError("a refused checkpoint was tried again")

    monkeypatch.setattr(tiny, "make_tiny_checkpoint", again)
    with pytest.raises(tiny.NoTinyCheckpoint) as second:
        tiny.tiny_checkpoint("EctpNoClassMultimodalModel", str(tmp_path), _MultimodalModel)
    assert str(second.value) == str(first.value)
    assert not (tmp_path / tiny.CHECKPOINTS_DIR / "EctpNoClassMultimodalModel").exists()
