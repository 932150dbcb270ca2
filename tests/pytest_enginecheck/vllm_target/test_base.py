"""The vLLM target's base modules without vLLM: failures.classify (the phase, the rank, the root exception, the
user's frames), env (the CPU engine's settings, the caches) and limits (the checker's own limits, each only in
the vLLM frame that refuses)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.pytest_enginecheck.vllm_target.helpers import _load_file

# --- failures.classify: the phase, the rank, the root exception, the user's own frames -------------------------

USER_MODEL = '''\
def forward(x):
    raise ValueError(f"shape mismatch: {x}")
'''
# Functions named as vLLM's startup phases (failures.PHASES), in a file outside this plugin: the classification
# reads frame names, so these stand for vLLM's frames.
ENGINE = '''\
def create_engine_config(model):
    return load_model(model)


def load_model(model):
    try:
        model.forward(3)
    except ValueError as e:
        raise RuntimeError("Worker failed with error 'shape mismatch: 3'") from e
'''


def test_classify_names_the_innermost_phase_the_root_exception_and_the_users_frames(tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.failures import classify

    (tmp_path / "user_model.py").write_text(USER_MODEL)
    (tmp_path / "fake_engine.py").write_text(ENGINE)
    model = _load_file(tmp_path / "user_model.py", "user_model")
    engine = _load_file(tmp_path / "fake_engine.py", "fake_engine")
    with pytest.raises(RuntimeError) as raised:
        engine.create_engine_config(model)
    failure = classify(raised.value, rank=1)
    assert (failure.phase, failure.rank) == ("load_model", 1)  # load_model runs inside create_engine_config
    assert failure.exception == "ValueError: shape mismatch: 3"  # the root, not the wrapper
    assert "user_model.py" in failure.user_frames and 'raise ValueError(f"shape mismatch: {x}")' in failure.user_frames
    assert "RuntimeError: Worker failed" in failure.traceback
    assert failure.describe("MyForCausalLM", 2) == (
        "MyForCausalLM failed in phase load_model on rank 1 at tensor_parallel_size=2: ValueError: shape mismatch: 3"
        f"\nIn your code:\n{failure.user_frames}")


def test_classify_keeps_library_and_plugin_frames_out_of_the_users_and_defaults_to_startup() -> None:
    from pytest_enginecheck.targets.vllm.failures import classify

    try:
        json.loads("{")  # raised in the standard library, called from this plugin's tests
    except ValueError as e:
        failure = classify(e, rank=0)
    assert failure.phase == "startup"
    assert failure.user_frames == ""
    assert failure.describe("X", 1) == f"X failed in phase startup on rank 0 at tensor_parallel_size=1: " \
                                       f"{failure.exception}"
    assert failure.exception.startswith("json.decoder.JSONDecodeError: Expecting property name")


def test_an_engine_failure_names_the_dtype_vllm_ran_in() -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure

    failure = EngineFailure("load_model", 0, "ValueError: bad shard", "", "")
    assert "at tensor_parallel_size=2 (bfloat16): ValueError: bad shard" in failure.describe("X", 2, "bfloat16")
    assert "at tensor_parallel_size=2: ValueError" in failure.describe("X", 2)


# --- env: the CPU engine's settings and where vLLM's caches go ------------------------------------------------

def test_cpu_engine_env_binds_one_core_per_rank_round_robin() -> None:
    from pytest_enginecheck.targets.vllm.env import KV_CACHE_GIB, cpu_engine_env

    cores = sorted(os.sched_getaffinity(0))
    env = cpu_engine_env(len(cores) + 1)
    bind = env["VLLM_CPU_OMP_THREADS_BIND"].split("|")
    assert bind == [str(c) for c in cores] + [str(cores[0])]  # one more rank than cores: back to the first
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == str(KV_CACHE_GIB)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert cpu_engine_env(1)["VLLM_CPU_OMP_THREADS_BIND"] == str(cores[0])


def test_redirect_caches_fills_only_the_variables_the_user_left_unset(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_enginecheck.targets.vllm.env import CACHE_VARIABLES, redirect_caches

    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/users/own/cache")
    redirect_caches(str(tmp_path))
    assert os.environ["VLLM_CACHE_ROOT"] == "/users/own/cache"
    for name in CACHE_VARIABLES[1:]:
        assert os.environ[name] == str(tmp_path / "caches" / name.lower())
        assert Path(os.environ[name]).is_dir()


# --- limits: the CPU MLA backend's float32 refusal, the attention features and the model runner V2 it lacks ----------

CPU_MLA_TRACEBACK = '''\
Traceback (most recent call last):
  File "/venv/site-packages/vllm/model_executor/model_loader/utils.py", line 200, in process_weights_after_loading
    module.process_weights_after_loading(act_dtype)
  File "/venv/site-packages/vllm/v1/attention/backends/mla/amx_mla.py", line 303, in process_weights_after_loading
    self._w_uk_packed = torch.ops._C.convert_weight_packed(w_uk_for_bmm)
  File "/venv/site-packages/torch/_ops.py", line 1279, in __call__
    return self._op(*args, **kwargs)
RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4).
'''


def test_the_cpu_mla_backends_float32_refusal_is_a_limit_only_in_its_own_frame() -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure
    from pytest_enginecheck.targets.vllm.limits import checker_limit

    exception = "RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4)."
    limit = checker_limit(EngineFailure("load_model", 0, exception, "", CPU_MLA_TRACEBACK))
    assert limit is not None and "amx_mla.py" in limit and "float32" in limit
    elsewhere = CPU_MLA_TRACEBACK.replace("backends/mla/amx_mla.py", "models/my_model.py")
    assert checker_limit(EngineFailure("load_model", 0, exception, "", elsewhere)) is None


def _attention_traceback(exception: str, file: str = "model_executor/layers/attention/attention.py") -> str:
    return f'''\
Traceback (most recent call last):
  File "/venv/site-packages/vllm/model_executor/models/step1.py", line 137, in __init__
    self.attn = Attention(
  File "/venv/site-packages/vllm/{file}", line 366, in __init__
    raise ValueError(
{exception}
'''


@pytest.mark.parametrize(("exception", "said"), [
    ("ValueError: use_alibi_sqrt is not supported by backend CPU_ATTN.", "CPU_ATTN attention backend"),
    ("TypeError: CPUAttentionBackendImpl.__init__() got an unexpected keyword argument 'chunk_lookback'",
     "takes no chunk_lookback"),
])
def test_an_attention_feature_the_cpu_backend_lacks_is_a_limit_only_in_vllms_attention_layer(exception: str,
                                                                                             said: str) -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure
    from pytest_enginecheck.targets.vllm.limits import checker_limit

    limit = checker_limit(EngineFailure("load_model", 0, exception, "", _attention_traceback(exception)))
    assert limit is not None and said in limit, limit
    elsewhere = _attention_traceback(exception, "model_executor/models/my_model.py")
    assert checker_limit(EngineFailure("load_model", 0, exception, "", elsewhere)) is None


def test_a_model_only_model_runner_v2_builds_is_a_limit_where_the_model_says_so() -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure
    from pytest_enginecheck.targets.vllm.limits import checker_limit

    exception = ("NotImplementedError: LongcatFlashNgramForCausalLM (LongCat-Flash-Lite) requires the V2 model runner "
                 "for its n-gram embedding state")
    traceback = _attention_traceback(exception, "model_executor/models/longcat_flash_ngram.py")
    limit = checker_limit(EngineFailure("load_model", 0, exception, "", traceback))
    assert limit is not None and "model runner V2, which needs Triton" in limit and "longcat_flash_ngram.py" in limit
    other = "NotImplementedError: my layer is not implemented"
    assert checker_limit(EngineFailure("load_model", 0, other, "", _attention_traceback(other, traceback))) is None


# --- limits: kernels and features vLLM's CPU backend lacks, each a limit only in the vLLM frame that refuses it ------
def _vllm_traceback(*frames: tuple[str, str], exception: str) -> str:
    """A traceback of ``frames`` ((file under site-packages, function), outermost first) raising ``exception``."""
    told = "".join(f'  File "/venv/site-packages/{file}", line 1, in {function}\n    call()\n'
                   for file, function in frames)
    return f"Traceback (most recent call last):\n{told}{exception}\n"


CPU_BACKEND_LIMITS = [
    ("NotImplementedError: Sparse Attention is not supported on CPU.",
     [("vllm/model_executor/layers/attention/mla_attention.py", "__init__"),
      ("vllm/platforms/cpu.py", "get_attn_backend_cls")], "no sparse attention backend"),
    ("AttributeError: '_OpNamespace' '_C' object has no attribute 'selective_scan_fwd'",
     [("vllm/model_executor/layers/mamba/ops/mamba_ssm.py", "selective_scan_fn"),
      ("vllm/_custom_ops.py", "selective_scan_fwd"), ("torch/_ops.py", "__getattr__")],
     "no selective_scan_fwd kernel"),
    ("AttributeError: '_OpNamespace' '_moe_C' object has no attribute 'topk_softmax'",
     [("vllm/model_executor/layers/fused_moe/router/fused_topk_bias_router.py", "vllm_topk_softmax"),
      ("vllm/_custom_ops.py", "topk_softmax"), ("torch/_ops.py", "__getattr__")],
     "no topk_softmax kernel (torch.ops._moe_C.topk_softmax"),
    ("NotImplementedError: is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now",
     [("vllm/model_executor/layers/fused_moe/layer.py", "FusedMoEFactory"),
      ("vllm/model_executor/layers/fused_moe/config.py", "__post_init__")], "is_act_and_mul=False"),
    ("AttributeError: '_lib_fn_wrapper' object has no attribute 'get'",
     [("vllm/platforms/cpu.py", "register_triton_kernel_overrides"),
      ("vllm/triton_utils/dispatcher.py", "_rebind_kernels")], "llvmlite's library wrapper"),
]


@pytest.mark.parametrize(("exception", "frames", "said"), CPU_BACKEND_LIMITS)
def test_a_feature_the_cpu_backend_lacks_is_a_limit_only_where_vllm_refuses_it(exception: str,
                                                                               frames: list[tuple[str, str]],
                                                                               said: str) -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure
    from pytest_enginecheck.targets.vllm.limits import checker_limit

    limit = checker_limit(EngineFailure("load_model", 0, exception, "", _vllm_traceback(*frames, exception=exception)))
    assert limit is not None and said in limit, limit
    # the same exception raised by the model's own file is the model's; so is a missing op the model looks up itself
    model = ("/plugin/my_model.py", "forward")
    bugs = [[*frames, model]] + ([[frames[0], model, frames[-1]]] if frames[-1][0] == "torch/_ops.py" else [])
    for bugged in bugs:
        traceback = _vllm_traceback(*bugged, exception=exception).replace("/venv/site-packages//plugin", "/plugin")
        assert checker_limit(EngineFailure("load_model", 0, exception, "", traceback)) is None, bugged


def test_only_the_kernel_rebinding_scan_has_the_check_start_vllm_again_in_vllms_own_layout() -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure
    from pytest_enginecheck.targets.vllm.limits import in_process_artifact

    def failure(exception: str, frames: list[tuple[str, str]]) -> EngineFailure:
        return EngineFailure("startup", 0, exception, "", _vllm_traceback(*frames, exception=exception))

    scan = CPU_BACKEND_LIMITS[-1]
    assert in_process_artifact(failure(scan[0], scan[1]))
    assert not in_process_artifact(failure(scan[0], [*scan[1], ("/plugin/my_model.py", "forward")]))
    assert not any(in_process_artifact(failure(exception, frames)) for exception, frames, _ in CPU_BACKEND_LIMITS[:-1])


def test_a_config_field_vllm_reads_from_another_schema_is_a_limit_only_for_the_known_pairs() -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure
    from pytest_enginecheck.targets.vllm.limits import checker_limit

    def limit(exception: str) -> str | None:
        frames = [("vllm/models/inkling/nvidia/model.py", "__init__")]
        traceback = _vllm_traceback(*frames, exception=exception)
        return checker_limit(EngineFailure("load_model", 0, exception, "", traceback))

    said = limit("AttributeError: 'InklingTextConfig' object has no attribute 'padded_vocab_size'")
    assert said is not None and said.startswith("the tiny config has no padded_vocab_size: ")
    assert "InklingModelConfig" in said
    assert limit("AttributeError: 'InklingTextConfig' object has no attribute 'rope_scaling'") is None  # the model's
    assert limit("AttributeError: 'LlamaConfig' object has no attribute 'padded_vocab_size'") is None


def _launch_traceback(file: str, source: str) -> str:
    return ('Traceback (most recent call last):\n  File "/venv/site-packages/vllm/model_executor/models/bailing.py", '
            f'line 9, in forward\n    out = attn(x)\n  File "{file}", line 439, in lightning_attention\n    {source}\n'
            "TypeError: 'function' object is not subscriptable\n")


def test_a_triton_kernel_launch_without_triton_is_a_limit_only_in_vllms_own_launch() -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure
    from pytest_enginecheck.targets.vllm.limits import checker_limit

    exception = "TypeError: 'function' object is not subscriptable"
    vllm_file = "/venv/site-packages/vllm/model_executor/layers/lightning_attn.py"
    limit = checker_limit(EngineFailure("generate", 0, exception, "",
                                        _launch_traceback(vllm_file, "_fwd_diag_kernel[grid](")))
    assert limit is not None and "launch the Triton kernel _fwd_diag_kernel (vllm/model_executor/layers/" \
        "lightning_attn.py in lightning_attention)" in limit, limit
    # the model's own file launching it, or vLLM's file subscripting a function otherwise, is not the limit
    for file, source in [("/plugin/my_model.py", "_fwd_diag_kernel[grid]("), (vllm_file, "weights = loader[0]")]:
        traceback = _launch_traceback(file, source)
        assert checker_limit(EngineFailure("generate", 0, exception, "", traceback)) is None, (file, source)


def test_a_frame_without_a_source_line_does_not_hide_the_frame_it_calls() -> None:
    from pytest_enginecheck.targets.vllm.limits import raised_in

    # a dataclass's generated __init__ shows no source line (FusedMoEConfig's, calling its __post_init__)
    traceback = ('Traceback (most recent call last):\n  File "<string>", line 38, in __init__\n'
                 '  File "/venv/site-packages/vllm/model_executor/layers/fused_moe/config.py", line 1402, in '
                 '__post_init__\n    raise NotImplementedError(\nNotImplementedError: x\n')
    assert raised_in(traceback) == ("/venv/site-packages/vllm/model_executor/layers/fused_moe/config.py",
                                    "__post_init__", "raise NotImplementedError(")


# --- limits: the processor files the checker's tiny checkpoint does not have ---------------------------------------
_NO_PREPROCESSOR = ("OSError: Can't load image processor for '{path}'. If you were trying to load it from "
                    "'https://huggingface.co/models', make sure you don't have a local directory with the same name. "
                    "Otherwise, make sure '{path}' is the correct path to a directory containing a "
                    "preprocessor_config.json file")
# HunYuanVL's start (vLLM's Transformers backend asking its processor for the modalities it supports), as vLLM 0.32
# raised it on the checker's tiny checkpoint
_PROCESSOR_FRAMES = [("vllm/config/model.py", "_supports_multimodal_inputs"),
                     ("vllm/model_executor/models/transformers/multimodal.py", "_get_audio_processor"),
                     ("vllm/transformers_utils/processor.py", "get_processor"),
                     ("transformers/processing_utils.py", "_get_arguments_from_pretrained"),
                     ("transformers/models/auto/image_processing_auto.py", "from_pretrained"),
                     ("transformers/image_processing_base.py", "get_image_processor_dict")]


def test_a_processor_file_the_tiny_checkpoint_lacks_is_a_limit_naming_it() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import CHECKPOINTS_DIR
    from pytest_enginecheck.targets.vllm.failures import EngineFailure
    from pytest_enginecheck.targets.vllm.limits import TINY_CHECKPOINTS_DIR, checker_limit

    assert TINY_CHECKPOINTS_DIR == CHECKPOINTS_DIR
    tiny = _NO_PREPROCESSOR.format(path=f"/tmp/enginecheck-x/{CHECKPOINTS_DIR}/HunYuanVLForConditionalGeneration")
    limit = checker_limit(EngineFailure("config", 0, tiny, "", _vllm_traceback(*_PROCESSOR_FRAMES, exception=tiny)))
    assert limit is not None, tiny
    assert limit.startswith("the checker's tiny checkpoint has no preprocessor_config.json"), limit
    assert "vllm/transformers_utils/processor.py in get_processor" in limit, limit
    # a checkpoint of the user's (not the checker's), or the model's own code raising it: the model's failure
    theirs = _NO_PREPROCESSOR.format(path="/models/my-vl-model")
    assert checker_limit(EngineFailure("config", 0, theirs, "",
                                       _vllm_traceback(*_PROCESSOR_FRAMES, exception=theirs))) is None
    own = _vllm_traceback(*_PROCESSOR_FRAMES[:-1], ("../plugin/my_model.py", "load"), exception=tiny)
    assert checker_limit(EngineFailure("config", 0, tiny, "", own)) is None
