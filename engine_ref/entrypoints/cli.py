"""The ``engine-ref`` command line: start an engine and print its startup report, and helpers."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from engine_ref import envs
from engine_ref.errors import ConfigError, EngineRefError

ENABLE_LORA_HELP = "enable LoRA adapters: preallocate max_loras adapter slots of max_lora_rank on every rank"
MAX_LORAS_HELP = "adapters one batch can use, each in its own preallocated slot (default 1)"
MAX_LORA_RANK_HELP = "the largest adapter rank r a slot holds (default 16)"
DASH_VALUE_OPTIONS = ("--device-memory",)  # options whose value may start with "-" ("-1GiB"): see main()
LORA_BASE_DIR = "base_model"  # where make-lora writes the tiny checkpoint, inside the adapter directory
QUANTIZATION_HELP = ("quantize the weights: fp8 (float8_e4m3fn, one scale per tensor), fbgemm_fp8 (one per channel) "
                     "or int8 (W8A16, one scale per channel); a bf16/fp32 checkpoint is converted at startup "
                     "(default: none, or the checkpoint's quantization_config)")


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="number of ranks the model is sharded over (default: 1)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks run (default: cpu)")
    parser.add_argument("--device-memory", default=None,
                        help="device capacity, e.g. 8GiB (simulated on CPU; default 4GiB there)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest request in tokens (default: the model's max_position_embeddings)")
    parser.add_argument("--dtype", default="auto",
                        help="float32, float16 or bfloat16 (default auto: config.json's torch_dtype)")
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy", "pt"],
                        help="how weights are read: safetensors files, random (dummy), or pytorch_model.bin (pt)")
    parser.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                        help="uni: in this process, mp: one process per rank, ray (default: uni at TP=1, else mp)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of each rank's device memory the engine may use (default: 0.9)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per scheduled batch, which sizes the profile run (default: max(max_model_len, "
                             "2048))")
    parser.add_argument("--quantization", "-q", default=None, metavar="METHOD", help=QUANTIZATION_HELP)
    _add_lora_args(parser)


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-lora", action="store_true", help=ENABLE_LORA_HELP)
    parser.add_argument("--max-loras", type=int, default=1, help=MAX_LORAS_HELP)
    parser.add_argument("--max-lora-rank", type=int, default=16, help=MAX_LORA_RANK_HELP)


def cmd_startup(args: argparse.Namespace) -> int:
    """Start the engine on a model directory (or a tiny checkpoint of an architecture), print the report."""
    from engine_ref.entrypoints.llm import LLM
    from engine_ref.isolation.tempdirs import owner_dir
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint
    from engine_ref.model_executor.models.registry import ModelRegistry
    from engine_ref.plugins import load_general_plugins

    load_general_plugins()  # before the registry is asked: a plugin's architecture is a valid MODEL
    # Inside this process's own temp dir: after a kill -9, the next engine_ref start sweeps it with the rest.
    with tempfile.TemporaryDirectory(prefix="startup-", dir=owner_dir()) as tmp:
        model = args.model
        if not Path(model).exists() and model in ModelRegistry.get_supported_archs():
            model = str(make_checkpoint(model, Path(tmp) / model))
        llm = LLM(
            model, tensor_parallel_size=args.tensor_parallel_size, device=args.device,
            device_memory=args.device_memory, max_model_len=args.max_model_len, dtype=args.dtype,
            load_format=args.load_format, distributed_executor_backend=args.distributed_executor_backend,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens, enable_lora=args.enable_lora,
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, quantization=args.quantization,
        )
        with llm:
            report = llm.startup_report
            print(report.to_json() if args.json else report.format_table())
        if args.trace:
            from engine_ref.tracing import write_startup_trace

            print(f"startup trace written to {write_startup_trace(report, args.trace)} "
                  f"(open it in https://ui.perfetto.dev or chrome://tracing)", file=sys.stderr)
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """Predict per-rank memory of a full-size config.json on a device, without weights; exit 1 if it does not fit."""
    from engine_ref.memory.estimate import estimate_memory

    estimate = estimate_memory(
        args.config, device_memory=args.device_memory, tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        quantization=args.quantization,
    )
    print(estimate.to_json() if args.json else estimate.format_table())
    return 0 if estimate.fits else 1


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    """Write a tiny random HF-layout checkpoint of an architecture."""
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint
    from engine_ref.plugins import load_general_plugins

    load_general_plugins()
    if args.quantization is None:
        path = make_checkpoint(args.architecture, args.path, seed=args.seed, dtype=args.dtype,
                               num_shards=args.num_shards)
    else:
        from engine_ref.model_executor.model_loader.quantized_checkpoint import make_quantized_checkpoint

        path = make_quantized_checkpoint(args.architecture, args.path, args.quantization, seed=args.seed,
                                         dtype=args.dtype, num_shards=args.num_shards)
    quantized = f" {args.quantization}" if args.quantization else ""
    print(f"wrote {args.architecture}{quantized} checkpoint to {path}")
    return 0


def cmd_make_lora(args: argparse.Namespace) -> int:
    """Write a tiny random PEFT adapter (fixed seed) for a tiny checkpoint of an architecture, or for --model."""
    from engine_ref.config import HFConfig
    from engine_ref.lora.checkpoint import make_lora
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint

    if args.model is None:
        model = make_checkpoint(args.architecture, Path(args.path) / LORA_BASE_DIR, seed=args.seed)
        print(f"wrote {args.architecture} checkpoint to {model}")
    else:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise ConfigError(f"--model {args.model!r} has no config.json; pass a model directory, e.g. one written "
                              f"by `engine-ref make-checkpoint {args.architecture} DIR`.")
        found = (HFConfig.from_file(model / "config.json").get("architectures") or ["(none)"])[0]
        if found != args.architecture:
            raise ConfigError(f"--model {args.model!r} is a {found}, not a {args.architecture}; pass its architecture "
                              f"or another model.")
    targets = args.target_modules.split(",") if args.target_modules else None
    path = make_lora(model, args.path, r=args.rank, lora_alpha=args.lora_alpha, target_modules=targets,
                     seed=args.seed)
    print(f"wrote a rank-{args.rank} LoRA adapter for {model} to {path}")
    return 0


def cmd_prepare_model_info(args: argparse.Namespace) -> int:
    """Inspect architectures in parallel warm processes and fill the ModelInfo cache
    (ENGINE_REF_CACHE_ROOT/modelinfos, by default ~/.cache/engine_ref/modelinfos)."""
    from engine_ref.model_executor.models.registry import ModelRegistry
    from engine_ref.plugins import load_general_plugins

    load_general_plugins()
    results = ModelRegistry.inspect_all(args.architectures or None, max_workers=args.max_workers)
    failed = 0
    for arch, result in results.items():
        if isinstance(result, Exception):
            failed += 1
            print(f"FAILED {arch}: {result}", file=sys.stderr)
        else:
            print(f"ok     {arch}")
    print(f"ModelInfo cache: {envs.cache_root() / 'modelinfos'}")
    return 1 if failed else 0


def cmd_list_models(args: argparse.Namespace) -> int:
    """Print every registered architecture and where it lives (imports nothing)."""
    from engine_ref.model_executor.models.registry import ModelRegistry
    from engine_ref.plugins import load_general_plugins

    load_general_plugins()
    entries = {arch: entry.spec for arch, entry in ModelRegistry.models.items()}
    if args.json:
        print(json.dumps(entries, indent=2))
    else:
        for arch, spec in entries.items():
            print(f"{arch:<34} {spec}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine-ref", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    p = sub.add_parser("startup", help=cmd_startup.__doc__)
    p.add_argument("model", help="a model directory, or a registered architecture (a tiny checkpoint is made)")
    _add_engine_args(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="also write a Chrome trace-event JSON of the startup (one track per rank) to FILE; "
                        "open it in https://ui.perfetto.dev or chrome://tracing")
    commands["startup"] = cmd_startup

    p = sub.add_parser("estimate", help=cmd_estimate.__doc__)
    p.add_argument("config", metavar="CONFIG_JSON_OR_DIR", help="a config.json (any file name) or a model directory")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="default: config.json's torch_dtype")
    p.add_argument("--device-memory", required=True, help="each rank's device memory, e.g. 80GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None, help="default: max_position_embeddings")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: max(max_model_len, 2048)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quantization", "-q", default=None, metavar="METHOD", help=QUANTIZATION_HELP)
    _add_lora_args(p)
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    commands["estimate"] = cmd_estimate

    p = sub.add_parser("make-checkpoint", help=cmd_make_checkpoint.__doc__)
    p.add_argument("architecture", help="a registered architecture (engine-ref list-models), e.g. LlamaForCausalLM")
    p.add_argument("path", help="the directory to write config.json and the safetensors files into")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="dtype of the weights written (default: float32)")
    p.add_argument("--num-shards", type=int, default=1,
                   help="split the weights over this many files with a model.safetensors.index.json (default: 1)")
    p.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="write it pre-quantized (8-bit weights, weight_scale tensors and config.json's "
                        "quantization_config): fp8, fbgemm_fp8 or int8 (default: unquantized)")
    commands["make-checkpoint"] = cmd_make_checkpoint

    p = sub.add_parser("make-lora", help=cmd_make_lora.__doc__)
    p.add_argument("architecture")
    p.add_argument("path", help="the adapter directory (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--model", default=None,
                   help=f"the checkpoint the adapter is for (default: a tiny one, written to PATH/{LORA_BASE_DIR})")
    p.add_argument("--rank", "-r", type=int, default=4, help="the adapter's rank r")
    p.add_argument("--lora-alpha", type=float, default=8.0)
    p.add_argument("--target-modules", default=None,
                   help="comma-separated modules, e.g. q_proj,v_proj (default: every module LoRA can run on)")
    p.add_argument("--seed", type=int, default=0)
    commands["make-lora"] = cmd_make_lora

    p = sub.add_parser("prepare-model-info", help=cmd_prepare_model_info.__doc__)
    p.add_argument("architectures", nargs="*", help="default: every registered architecture")
    p.add_argument("--max-workers", type=int, default=None,
                   help="architectures inspected at once (default: the number of CPUs)")
    commands["prepare-model-info"] = cmd_prepare_model_info

    p = sub.add_parser("list-models", help=cmd_list_models.__doc__)
    p.add_argument("--json", action="store_true")
    commands["list-models"] = cmd_list_models

    for p in sub.choices.values():
        p.add_argument("--verbose", "-v", action="store_true",
                       help="on an error, print all of it (a worker's or child's traceback), not its first line")
    parser.set_defaults(commands=commands)
    return parser


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--device-memory -1GiB`` -> ``--device-memory=-1GiB``.

    argparse takes a value starting with "-" for an option and says "expected one argument"; joined,
    the value reaches the engine's own check, whose error names the field.
    """
    joined: list[str] = []
    for arg in argv:
        if joined and joined[-1] in DASH_VALUE_OPTIONS and arg.startswith("-"):
            joined[-1] = f"{joined[-1]}={arg}"
        else:
            joined.append(arg)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``engine-ref``: our errors print as one clear line, never a traceback.

    An error that carries more (a worker's traceback) prints its first line; ``--verbose`` prints all of it.
    """
    parser = build_parser()
    args = parser.parse_args(_join_dash_values(sys.argv[1:] if argv is None else argv))
    try:
        return args.commands[args.command](args)
    except EngineRefError as e:
        message, _, rest = str(e).partition("\n")
        if rest.strip():
            message = str(e) if args.verbose else f"{message} (--verbose prints the rest of this error)"
        print(f"engine-ref: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
