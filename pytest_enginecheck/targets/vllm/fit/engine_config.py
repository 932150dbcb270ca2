"""vLLM's config objects (``VllmConfig``) for a user's config.json at TP=N, as ``vllm serve`` makes them on a GPU.

The objects come from vLLM's own ``EngineArgs.create_engine_config`` in this (CPU) process, so vLLM validates the
input as it would at startup (TP dividing the heads, max_model_len within the model's, the dtype, the KV-cache
dtype) and its message is the error. Where vLLM's CPU platform sets what the GPU would not, the GPU's value is given
or put back: the dtype ("auto" resolved as on CUDA: the checkpoint's, float32 checkpoints in bfloat16), the block
size (CUDA's 16; 64 for MLA), the SSM state dtype, and ``vllm serve``'s scheduler defaults for that GPU size (also
for MLA models, whose batches the CPU platform resizes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.vllm.fit import FitError

GiB = 1 << 30
CUDA_BLOCK_SIZE = 16  # vLLM's default block size on CUDA (FlashAttention, FlashInfer)
MLA_BLOCK_SIZE = 64  # FlashMLA's, the default MLA backend on Hopper
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16")
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ServeArgs:
    """The arguments of ``vllm serve`` the prediction takes (vLLM's names); None: vLLM's default on that GPU."""

    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    enforce_eager: bool = False


def serve_defaults(gpu_memory: int) -> tuple[int, int]:
    """``vllm serve``'s (max_num_batched_tokens, max_num_seqs) on a GPU of this size (vLLM's
    ``EngineArgs.get_batch_defaults``, OPENAI_API_SERVER; an A100 of 80 GB gets the small ones, which this cannot
    tell from the size alone)."""
    if gpu_memory >= 160 * GiB:
        return 16384, 1024
    if gpu_memory >= 70 * GiB:
        return 8192, 1024
    return 2048, 256


def read_config(path: str | Path) -> dict[str, Any]:
    """The config.json at ``path`` (a file or a model directory) as a dict with ``architectures``."""
    given = Path(path)
    file = given / "config.json" if given.is_dir() else given
    if not file.is_file():
        raise FitError(f"{str(path)!r} is neither a config.json file nor a directory holding one; give the path of "
                       f"the model's config.json (the one on its hub page)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FitError(f"{str(file)!r} is not a JSON config ({e}); give the model's config.json") from None
    if not isinstance(config, dict) or not config.get("architectures"):
        raise FitError(f"{str(file)!r} names no \"architectures\"; a Hugging Face config.json lists the model class, "
                       f"e.g. \"architectures\": [\"LlamaForCausalLM\"]")
    return config


@contextlib.contextmanager
def model_directory(path: str | Path) -> Iterator[Path]:
    """A directory holding the config.json at ``path`` (a copy, so nothing is written beside the user's file)."""
    read_config(path)
    given = Path(path)
    with tempfile.TemporaryDirectory(prefix="enginecheck-fit-") as tmp:
        shutil.copyfile(given / "config.json" if given.is_dir() else given, Path(tmp) / "config.json")
        yield Path(tmp)


def cuda_dtype(config: dict[str, Any], dtype: str) -> str:
    """``--dtype`` as vLLM resolves it on CUDA: "auto" is the checkpoint's dtype, bfloat16 for a float32 one."""
    if dtype != "auto":
        return dtype
    text: dict[str, Any] = config["text_config"] if isinstance(config.get("text_config"), dict) else {}
    declared = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "bfloat16")
    declared = declared.removeprefix("torch.")
    return "bfloat16" if declared in ("float32", "float") else declared


def gpu_vllm_config(model_dir: Path, args: ServeArgs, gpu_memory: int) -> Any:
    """vLLM's ``VllmConfig`` for ``model_dir`` with ``args`` as a GPU of ``gpu_memory`` bytes would get it; vLLM's
    refusal (TP not dividing the heads, max_model_len too long, an unknown architecture) is a FitError quoting it."""
    from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import ENGINE_ARGS_CLASS
    from pytest_enginecheck.targets.vllm.fit.platform import making_config
    from pytest_enginecheck.targets.vllm.probe import find

    config = read_config(model_dir)
    batched, seqs = serve_defaults(gpu_memory)
    engine_args = find(ENGINE_ARGS_CLASS, "the fit prediction makes vLLM's config objects with")
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len, dtype=cuda_dtype(config, args.dtype), kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        max_num_batched_tokens=args.max_num_batched_tokens or batched, max_num_seqs=args.max_num_seqs or seqs)
    architecture = config["architectures"][0]
    inspect_here(config["architectures"])
    try:
        with making_config():
            vllm_config = engine_args(**kwargs).create_engine_config()
    except Exception as e:  # noqa: BLE001 - vLLM's refusal of the input, in its words
        raise FitError(refusal(architecture, args, _first_line(e))) from None
    cache = vllm_config.cache_config
    use_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    cache.block_size = args.block_size or (MLA_BLOCK_SIZE if use_mla else CUDA_BLOCK_SIZE)
    # the CPU platform sizes an MLA model's batches to max(max_model_len, 2048) tokens (no chunked prefill on the
    # CPU); on a GPU they are the ones asked for, which the profile run's activation peak depends on
    vllm_config.scheduler_config.max_num_batched_tokens = kwargs["max_num_batched_tokens"]
    if hasattr(cache, "mamba_ssm_cache_dtype"):  # the CPU platform resets it to float32
        cache.mamba_ssm_cache_dtype = "auto"
    return vllm_config


def inspect_here(architectures: list[str]) -> None:
    """Register each of ``architectures`` with vLLM's registry as its class imported here (``register_model`` with the
    class, vLLM's own call), so vLLM makes its ModelInfo in this process: for a lazily registered class it would start
    a subprocess to inspect it wherever its cache (``~/.cache/vllm/modelinfos``, one file per class) was written by
    another release, 7.5 s here. The fit imports the class in this process anyway, to build it; one that does not
    import is left to vLLM, whose own inspection then says why."""
    from pytest_enginecheck.targets.vllm.probe import probe

    registry = probe().registry
    for architecture in architectures:
        entry = registry.models.get(architecture)
        if entry is None or getattr(entry, "model_cls", None) is not None:
            continue  # unknown (vLLM refuses it in its words), or imported already
        try:
            model_cls = entry.load_model_cls()
        except Exception:  # noqa: BLE001 - vLLM's inspection reports it, as at startup
            continue
        log = logging.getLogger(type(registry).__module__)  # vLLM logs the overwrite (a warning in some releases)
        was_disabled, log.disabled = log.disabled, True
        try:
            registry.register_model(architecture, model_cls)
        finally:
            log.disabled = was_disabled


def derived_max_model_len(vllm_config: Any) -> int:
    """The model's own maximum length (vLLM's derived max_model_len), the bound of the search for the largest
    max_model_len that fits."""
    model_config = vllm_config.model_config
    verify = getattr(model_config, "get_and_verify_max_len", None)
    if verify is None:
        return int(model_config.max_model_len)
    try:
        return int(verify(None))
    except Exception:  # noqa: BLE001 - an older vLLM's signature: the configured length is the bound
        return int(model_config.max_model_len)


# What to change, by a phrase of vLLM's refusal
FIXES = (("are not supported for now", "check config.json's \"architectures\": vLLM's registry has no such class "
                                       "(a model of vLLM's general plugins must be installed where this runs)"),
         ("must be divisible by tensor parallel size", "give a --tp that divides it"),
         ("greater than the derived max_model_len", "give a --max-model-len of at most the model's maximum"),
         ("kv_cache_dtype", f"give a --kv-cache-dtype vLLM knows ({', '.join(KV_CACHE_DTYPES)})"),
         ("dtype", f"give a --dtype vLLM knows ({', '.join(DTYPES)})"))


def refusal(architecture: str, args: ServeArgs, message: str) -> str:
    """vLLM's refusal of ``architecture`` with ``args``, with what to change."""
    if "are not supported for now" in message:
        message = f"Model architectures ['{architecture}'] are not supported for now."
    fix = next((fix for phrase, fix in FIXES if phrase in message), "change the argument vLLM names")
    return (f"vLLM refuses {architecture} at tensor_parallel_size={args.tensor_parallel_size}: {message} Fix: "
            f"{fix}.")


def _first_line(error: BaseException) -> str:
    """vLLM's message without pydantic's decorations (its header, "Value error, ", the input echo, the link)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    kept = [line for line in lines if "errors.pydantic.dev" not in line and "validation error" not in line]
    text = " ".join(kept or lines).removeprefix("Value error, ")
    return text.split(" [type=", 1)[0][:1000]
