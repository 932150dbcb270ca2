"""Issue 19: vLLM's engine failing on the checker's own tiny checkpoint is a skip only where the failure is provably a
limit of the checker (targets/vllm/limits.py: a kernel vLLM's CPU backend lacks, ...); a model that raises while vLLM
starts it stays a failure, and one vLLM cannot inspect fails its engine checks for the inspect check's cause."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.settings import Settings

PLUGIN = "enginecheck_limits"
SOURCES = {
    "eclm/__init__.py": '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EclmLayer1LoadRaisesForCausalLM", "eclm.models:EclmLayer1LoadRaisesForCausalLM")
    ModelRegistry.register_model("EclmInspectRaisesForCausalLM", "eclm.models:EclmInspectRaisesForCausalLM")
    for name in ("EclmSparseRaisesForCausalLM", "EclmNotGatedRaisesForCausalLM", "EclmMissingOpForCausalLM"):
        ModelRegistry.register_model(name, f"eclm.models:{name}")
''',
    "eclm/models.py": '''\
from vllm.model_executor.models.llama import LlamaForCausalLM


class EclmLayer1LoadRaisesForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights):
        def checked(weights):
            for name, weight in weights:
                # The bug under test: layer 1's weights are refused while loading, layer 0's load.
                if name.startswith("model.layers.1."):
                    raise ValueError(f"eclm: cannot load {name}")
                yield name, weight

        return super().load_weights(checked(weights))


class _Unbuilt:
    def __get__(self, obj, owner):
        raise RuntimeError("eclm: the pruning table is not built")


class EclmInspectRaisesForCausalLM(LlamaForCausalLM):
    supported_video_pruning_methods = _Unbuilt()  # read by vLLM's ModelInfo


# Twins of vLLM CPU-backend limits (limits.py): the same exception, raised from the model's own file, is the model's.
class EclmSparseRaisesForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        raise NotImplementedError("Sparse Attention is not supported on CPU.")


class EclmNotGatedRaisesForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        raise NotImplementedError("is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now")


class EclmMissingOpForCausalLM(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        import torch

        torch.ops._C.selective_scan_fwd  # the bug under test: an op vLLM's CPU build lacks, called by the model
        return super().forward(*args, **kwargs)
''',
}


@pytest.fixture(scope="module")
def limits_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site dir with one real plugin distribution registering the planted models above."""
    site = tmp_path_factory.mktemp("vllm-limits-site")
    for relative, text in SOURCES.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_text(text)
    info = site / "enginecheck_vllm_limits-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: enginecheck-vllm-limits\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN} = eclm:register\n")
    return site


def _in_site(site: str, fn: Callable[..., Any], *args: Any) -> Any:
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    os.environ["VLLM_PLUGINS"] = PLUGIN
    sys.path.insert(0, site)
    importlib.invalidate_caches()
    return fn(*args)


@pytest.fixture
def in_limits_child(limits_site: Path) -> Callable[..., Any]:
    """Run ``fn(*args)`` in a warm check child that loads only the plugin above."""
    from engine_ref.isolation import run_isolated

    def run(fn: Callable[..., Any], *args: Any) -> Any:
        return run_isolated(_in_site, str(limits_site), fn, *args, timeout=600.0)

    return run


def _outcome(check: str, workdir: str, architecture: str) -> tuple[str, str, dict[str, Any]]:
    """``check`` of ``architecture`` at TP=1: (outcome, message, detail with the failure's cause)."""
    from pytest_enginecheck.checks.causes import failure_cause
    from pytest_enginecheck.targets.vllm.checks import CHECK_FUNCTIONS

    ctx = CheckContext(check=check, spec="vllm", architecture=architecture, module="", class_name="",
                       workdir=workdir, tp=1, options=Settings(timeout=300.0))
    try:
        return "passed", "", CHECK_FUNCTIONS[check](ctx)
    except CheckSkip as e:
        return "skipped", str(e), {}
    except CheckFailure as e:
        return "failed", e.message, {**e.detail, "cause": failure_cause(ctx, e.message, e.detail, e)}


def test_a_kernel_vllms_cpu_backend_lacks_is_a_skip_naming_it(in_limits_child: Any, tmp_path: Path) -> None:
    # OLMo hybrid's gated delta-net layer sets Triton's allocator, and vLLM's CPU backend has no Triton.
    outcome, message, _ = in_limits_child(_outcome, "load", str(tmp_path), "OlmoHybridForCausalLM")
    assert outcome == "skipped", message
    assert message.startswith("vLLM's engine cannot run the checker's tiny checkpoint of OlmoHybridForCausalLM at "
                              "tensor_parallel_size=1 (float32) in phase load_model: vLLM's CPU backend has no "
                              "Triton (the installed triton has no CPU backend and no triton.set_allocator)"), message
    assert "olmo_gdn_linear_attn.py" in message


@pytest.mark.parametrize(("architecture", "dtype", "phase", "reason"), [
    ("DeepseekV32ForCausalLM", "bfloat16", "load_model",
     "vLLM's CPU platform (platforms/cpu.py get_attn_backend_cls) has no sparse attention backend"),
    ("MambaForCausalLM", "float32", "generate",
     "vLLM's CPU build has no selective_scan_fwd kernel (torch.ops._C.selective_scan_fwd, which vllm/_custom_ops.py "
     "calls, is built for CUDA only), and the model's layers call it (vllm/model_executor/layers/mamba/ops/"
     "mamba_ssm.py in selective_scan_fn)"),
    ("NemotronHForCausalLM", "float32", "load_model",
     "vLLM's fused MoE (layers/fused_moe/config.py FusedMoEConfig) runs experts whose activation is not gated "
     "(is_act_and_mul=False) only on CUDA, XPU and ROCm"),
    ("LongcatFlashForCausalLM", "bfloat16", "generate",
     "vLLM's CPU build has no topk_softmax kernel (torch.ops._moe_C.topk_softmax, which vllm/_custom_ops.py calls, "
     "is built for CUDA only)"),
    ("BailingMoeV2_5ForCausalLM", "bfloat16", "generate",
     "vLLM's CPU backend has no Triton, and the model's layers launch the Triton kernel _fwd_diag_kernel "
     "(vllm/model_executor/layers/lightning_attn.py in forward)"),
    # vLLM's Transformers backend asks HunYuanVL's processor for its modalities while it builds the config
    ("HunYuanVLForConditionalGeneration", "float32", "config",
     "the checker's tiny checkpoint has no preprocessor_config.json (it writes config.json, the weights and, where "
     "vLLM reads one, a tokenizer; no processor files), and vLLM reads the model's image processor from it while it "
     "starts (vllm/transformers_utils/processor.py in get_processor)"),
])
def test_a_feature_vllms_cpu_backend_lacks_is_a_skip_naming_it(in_limits_child: Any, tmp_path: Path, architecture: str,
                                                                dtype: str, phase: str, reason: str) -> None:
    outcome, message, _ = in_limits_child(_outcome, "load", str(tmp_path), architecture)
    assert outcome == "skipped", message
    assert message.startswith(f"vLLM's engine cannot run the checker's tiny checkpoint of {architecture} at "
                              f"tensor_parallel_size=1 ({dtype}) in phase {phase}: {reason}"), message


def test_a_model_whose_processor_imports_numba_runs_in_vllms_own_layout(in_limits_child: Any, tmp_path: Path) -> None:
    # Kimi K2.5's processor imports numba; in the warm ranks (front end and worker one process) vLLM CPU's
    # Triton-kernel rebinding scan then breaks on llvmlite (limits.py), so the check starts vLLM's spawned layout.
    outcome, message, detail = in_limits_child(_outcome, "load", str(tmp_path), "KimiK25ForConditionalGeneration")
    assert outcome == "passed", message
    assert detail["dtype"] == "bfloat16" and all(len(tokens) > 0 for tokens in detail["tokens"]), detail
    assert detail["start_mode"] == "spawn", detail  # vLLM's own layout, after the warm ranks met the scan


def test_vllms_kimi_linear_importing_a_cuda_kernel_while_built_is_the_models_failure(in_limits_child: Any,
                                                                                     tmp_path: Path) -> None:
    # vLLM 0.32's kimi_k3 model imports its CUTLASS-DSL GEMM kernel when VLLM_KIMI_K3_GEMM_AR is on (the default),
    # on every platform: a failure of the model on this platform, not a limit of the checker.
    outcome, message, detail = in_limits_child(_outcome, "load", str(tmp_path), "KimiLinearForCausalLM")
    assert outcome == "failed", message
    assert "ModuleNotFoundError: No module named 'cutlass'" in message, message
    assert detail["cause"] == "ModuleNotFoundError: No module named 'cutlass'"


@pytest.mark.parametrize(("architecture", "phase", "exception"), [
    ("EclmSparseRaisesForCausalLM", "load_model", "NotImplementedError: Sparse Attention is not supported on CPU."),
    ("EclmNotGatedRaisesForCausalLM", "load_model",
     "NotImplementedError: is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now"),
    ("EclmMissingOpForCausalLM", "generate",
     "AttributeError: '_OpNamespace' '_C' object has no attribute 'selective_scan_fwd'"),
])
def test_a_cpu_backend_limits_exception_raised_by_the_model_itself_still_fails(in_limits_child: Any, tmp_path: Path,
                                                                               architecture: str, phase: str,
                                                                               exception: str) -> None:
    outcome, message, detail = in_limits_child(_outcome, "load", str(tmp_path), architecture)
    assert outcome == "failed", message
    assert message.startswith(f"{architecture} failed in phase {phase} on rank 0 at tensor_parallel_size=1 (float32): "
                              f"{exception}"), message
    assert detail["cause"] == exception


def test_a_model_that_raises_while_loading_layer_1_still_fails(in_limits_child: Any, tmp_path: Path) -> None:
    outcome, message, detail = in_limits_child(_outcome, "load", str(tmp_path), "EclmLayer1LoadRaisesForCausalLM")
    assert outcome == "failed", message
    assert message.startswith("EclmLayer1LoadRaisesForCausalLM failed in phase load_model on rank 0 at "
                              "tensor_parallel_size=1 (float32): ValueError: eclm: cannot load "
                              "model.layers.1."), message
    assert detail["cause"].startswith("ValueError: eclm: cannot load model.layers.1.")


def test_an_inspection_error_fails_the_engine_checks_for_the_inspect_checks_cause(in_limits_child: Any,
                                                                                 tmp_path: Path) -> None:
    arch = "EclmInspectRaisesForCausalLM"
    inspect, load = (in_limits_child(_outcome, check, str(tmp_path / check), arch) for check in ("inspect", "load"))
    assert inspect[0] == load[0] == "failed", (inspect, load)
    assert inspect[1].startswith("RuntimeError: eclm: the pruning table is not built (vLLM inspecting "), inspect[1]
    assert load[1].startswith("vLLM cannot inspect the class, so no engine starts (the inspect check fails for it "
                              "too): RuntimeError: eclm: the pruning table is not built"), load[1]
    assert load[2]["cause"] == inspect[2]["cause"] == "RuntimeError: eclm: the pruning table is not built"


def test_the_transformers_backend_lists_are_a_kind_decided_by_the_model_info() -> None:
    from pytest_enginecheck.targets.vllm.probe import MIXED_KINDS, probe

    api = probe()
    backend = {arch for name in ("_TRANSFORMERS_SUPPORTED_MODELS", "_TRANSFORMERS_BACKEND_MODELS")
               for arch in getattr(api.registry_module, name)}
    assert len(backend) >= 30  # 32 in vLLM 0.32
    assert {arch for arch, kind in api.model_kinds.items() if kind == "transformers backend"} == backend
    assert MIXED_KINDS == ("transformers backend",)
