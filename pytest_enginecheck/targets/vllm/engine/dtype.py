"""The dtype the engine starts a checkpoint in: float32, or bfloat16 where vLLM builds the model with MLA attention.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.args import checkpoint_args
from pytest_enginecheck.targets.vllm.env import ENGINE_ARGS
from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, model_initializer

# The dtype of a model vLLM builds with MLA attention (``uses_mla``): vLLM's CPU MLA backend packs its absorbed weights
# with a kernel that takes bfloat16, float16 or int8 only (attention/backends/mla/amx_mla.py, "expect weight to be
# bfloat16"); bfloat16 is what vLLM picks for such a model by default.
MLA_DTYPE = "bfloat16"


def uses_mla(text_config: Any, is_deepseek_mla: bool, *, transformers_backend: bool = False,
             mla_disabled: bool = False) -> bool:
    """vLLM's ``ModelConfig.use_mla`` for a model whose text config is ``text_config``: ``is_deepseek_mla`` is what
    vLLM's model-arch convertor says of it (its list of MLA model types, each with ``kv_lora_rank`` set), a model of
    vLLM's Transformers backend uses MLA where its config has a ``kv_lora_rank``, a bidirectional one
    (``is_causal=False``) never does, and ``VLLM_MLA_DISABLE`` (``mla_disabled``) turns it off for all."""
    if mla_disabled:
        return False
    if transformers_backend:
        return getattr(text_config, "kv_lora_rank", None) is not None
    return bool(getattr(text_config, "is_causal", True)) and is_deepseek_mla


def vllm_uses_mla(ckpt: str, transformers_backend: bool = False) -> bool:
    """Whether vLLM builds the checkpoint at ``ckpt`` with MLA attention (``uses_mla`` over the config vLLM reads,
    with vLLM's own convertor deciding ``is_deepseek_mla``), without building vLLM's whole ModelConfig (which
    inspects the model class in a subprocess: about a minute here)."""
    try:
        import vllm.config  # noqa: F401 - first: the convertor's module imports vllm.config (a cycle the other way)
        from vllm import envs
        from vllm.transformers_utils.config import get_config, get_hf_text_config
        from vllm.transformers_utils.model_arch_config_convertor import (
            MODEL_ARCH_CONFIG_CONVERTORS,
            ModelArchConfigConvertorBase,
        )
    except ImportError as e:
        raise VllmUnavailable(f"vLLM's config reader or model-arch convertor is missing ({e}): the engine checks "
                              f"cannot tell whether vLLM builds the model with MLA attention") from None
    hf_config = get_config(ckpt, trust_remote_code=bool(checkpoint_args(ckpt).get("trust_remote_code")))
    text_config = get_hf_text_config(hf_config)
    convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(hf_config.model_type, ModelArchConfigConvertorBase)
    return uses_mla(text_config, convertor(hf_config, text_config).is_deepseek_mla(),
                    transformers_backend=transformers_backend, mla_disabled=bool(envs.VLLM_MLA_DISABLE))


# vLLM's MLA layers: a model module that refers to one may build MLA attention whatever ``use_mla`` says.
MLA_LAYERS = ("MultiHeadLatentAttentionWrapper", "MLAAttention")
MLA_BUILD_TIMEOUT_S = 120.0


def refers_to_mla(model_cls: type) -> bool:
    """Whether a module of ``model_cls`` or of a class it derives from refers to one of vLLM's MLA_LAYERS."""
    modules = {sys.modules.get(cls.__module__) for cls in model_cls.__mro__}
    return any(name in vars(module) for module in modules if module is not None for name in MLA_LAYERS)


def _meta_model_has_mla(ckpt: str) -> bool:
    """Run in a fork (building vLLM's model initialises torch.distributed): whether vLLM's TP=1 model of ``ckpt``,
    built on the meta device under vLLM's config objects of the checkpoint, has an MLAAttention layer."""
    from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import built_model, vllm_model

    with vllm_model(ckpt) as build:
        model = built_model(model_initializer(), build.vllm_config, "meta")
    return any(cls.__name__ == "MLAAttention" for module in model.modules() for cls in type(module).__mro__)


def builds_mla(ckpt: str) -> bool:
    """Whether vLLM's model of the checkpoint at ``ckpt`` has MLA attention though ``ModelConfig.use_mla`` says no
    (SarvamMLA builds vLLM's MultiHeadLatentAttentionWrapper in every layer, and vLLM's list of MLA model types has
    not its ``sarvam_mla``, the hub checkpoints' too): where the model class's modules refer to vLLM's MLA layers, its
    model is built on the meta device (in a fork, about 5 s) and looked through. False where it cannot be built: the
    engine start that builds the same model gives the verdict."""
    import json

    from engine_ref.isolation import run_isolated
    from pytest_enginecheck.targets.vllm.describe.registry import import_model_class, list_architectures

    with open(os.path.join(ckpt, "config.json")) as f:
        architecture = (json.load(f).get("architectures") or [""])[0]
    entry = next((e for e in list_architectures() if e.architecture == architecture), None)
    model_cls = import_model_class(entry).model_cls if entry is not None else None
    if model_cls is None or not refers_to_mla(model_cls):
        return False
    try:
        return bool(run_isolated(_meta_model_has_mla, ckpt, timeout=MLA_BUILD_TIMEOUT_S, name="vllm-mla:meta"))
    except Exception:  # noqa: BLE001 - reported by the engine start that builds the same model
        return False


def engine_dtype(ckpt: str, transformers_backend: bool = False) -> str:
    """The dtype the engine checks start vLLM in for ``ckpt``: ENGINE_ARGS' float32, or MLA_DTYPE where vLLM builds
    the model with MLA attention (``vllm_uses_mla``, or ``builds_mla`` for a model that builds it whatever vLLM's
    ``use_mla`` says). Where vLLM cannot even read the config, float32: the engine start then meets the same error
    and gives the verdict (a config-phase failure, or limits.py's skip)."""
    try:
        mla = vllm_uses_mla(ckpt, transformers_backend) or (not transformers_backend and builds_mla(ckpt))
    except VllmUnavailable:
        raise
    except Exception:  # noqa: BLE001 - reported by the engine start that reads the same config
        mla = False
    return MLA_DTYPE if mla else str(ENGINE_ARGS["dtype"])
