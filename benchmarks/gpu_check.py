"""What CPU CI cannot prove, proven once on a real CUDA machine (about a minute; under 5 on any GPU).

1. guard: the import check (a fork of the warm parent, CUDA guard on) catches a module that calls
   ``torch.cuda.get_device_properties`` at import, on a CUDA build with a GPU present, naming the
   API and the line; afterwards a clean module's check passes and a fresh fork still uses CUDA.
2. strict: the strict import check flags a module calling ``torch.cuda.is_available()`` at import;
   the default one lets it pass.
3. engine: an engine_ref engine starts on ``cuda`` at TP=1 in a worker process (the mp executor,
   a fork of the warm parent), generates, and shuts down; nccl all-reduces on the GPU (one rank, and
   the engine at TP=2 when two GPUs are visible).
4. memory: the engine's torch.cuda-based accounting agrees with the meta-device estimate: weights and
   buffers exactly, the activation peak within ACTIVATION_RTOL of it plus ACTIVATION_ATOL (the caching
   allocator rounds blocks and holds cuBLAS's workspace, which the estimate does not model), the KV
   cache within the blocks that tolerance is worth.

    python benchmarks/gpu_check.py

Prints one line per check and exits 1 if any fails; on a machine without a CUDA device it prints
``SKIP: no CUDA device`` and exits 0. This process never initializes CUDA itself: every CUDA call
runs in a child, so the forks that follow it stay valid.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask NVML, not cuInit, whether a GPU is there

ACTIVATION_RTOL = 0.10
ACTIVATION_ATOL = 64 * 1024**2  # cuBLAS's workspace and the allocator's block rounding
ENGINE: dict[str, Any] = {"device": "cuda", "device_memory": "4GiB", "max_model_len": 512,
                          "max_num_batched_tokens": 1024, "dtype": "float16"}
# Large enough that the weights and activations dwarf allocator noise, small enough for any GPU.
MODEL_OVERRIDES = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
                   "max_position_embeddings": 512}
ZOO = {
    "offender.py": "import torch\n\nSM_COUNT = torch.cuda.get_device_properties(0).multi_processor_count\n\n\n"
                   "class Model:\n    pass\n",
    "queries.py": "import torch\n\nHAS_GPU = torch.cuda.is_available()\n\n\nclass Model:\n    pass\n",
    "clean.py": "import functools\n\nimport torch\n\n\n@functools.cache\ndef sm_count() -> int:\n"
                "    return torch.cuda.get_device_properties(0).multi_processor_count\n\n\n"
                "class Model:\n    pass\n",
}
MODELS = {"OffenderModel": "gpu_check_zoo.offender:Model", "QueriesModel": "gpu_check_zoo.queries:Model",
          "CleanModel": "gpu_check_zoo.clean:Model"}

failures: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def no_cuda_reason() -> str | None:
    import torch

    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA"
    if not torch.cuda.is_available():  # NVML-based (see above): does not initialize CUDA here
        return "no GPU is visible (nvidia-smi / CUDA_VISIBLE_DEVICES)"
    return None


def import_check(workdir: str, arch: str, strict: bool) -> Any:
    from pytest_enginecheck.checks import CheckContext
    from pytest_enginecheck.checks.runner import run_check

    module, class_name = MODELS[arch].split(":")
    return run_check(CheckContext(check="import", spec="gpu_check_zoo:MODELS", architecture=arch, module=module,
                                  class_name=class_name, workdir=workdir, strict=strict, timeout=120.0))


def uses_cuda() -> str:
    import torch

    x = torch.ones(1024, device="cuda")
    return f"{torch.cuda.get_device_name(0)}, sum={float((x * 2).sum().item()):g}"


def nccl_all_reduce(store: str) -> float:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", world_size=1, rank=0,
                            timeout=timedelta(seconds=60))
    try:
        x = torch.full((4,), 3.0, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        return float(x[0].item())
    finally:
        dist.destroy_process_group()


def check_guard(workdir: str) -> None:
    import torch

    from engine_ref.isolation import run_isolated

    offender = import_check(workdir, "OffenderModel", strict=False)
    detail = offender.detail
    line = (Path(workdir) / "gpu_check_zoo" / "offender.py").read_text().splitlines().index(
        "SM_COUNT = torch.cuda.get_device_properties(0).multi_processor_count") + 1
    report("guard catches get_device_properties at import",
           offender.outcome == "failed" and detail.get("api") == "torch.cuda.get_device_properties"
           and detail.get("line") == line, offender.message.splitlines()[0] if offender.message else offender.outcome)
    clean = import_check(workdir, "CleanModel", strict=False)
    report("a clean module passes afterwards", clean.outcome == "passed", clean.message or "passed")
    try:
        used = run_isolated(uses_cuda, timeout=120)
        ok = not torch.cuda.is_initialized()
        report("a fork of the warm parent still uses CUDA", ok, f"{used}; this process initialized CUDA: {not ok}")
    except Exception as e:  # noqa: BLE001 - reported as the failure it is
        report("a fork of the warm parent still uses CUDA", False, f"{type(e).__name__}: {e}")


def check_strict(workdir: str) -> None:
    strict = import_check(workdir, "QueriesModel", strict=True)
    report("strict mode flags is_available() at import",
           strict.outcome == "failed" and strict.detail.get("api") == "torch.cuda.is_available",
           strict.message.splitlines()[0] if strict.message else strict.outcome)
    default = import_check(workdir, "QueriesModel", strict=False)
    report("the default mode lets is_available() pass", default.outcome == "passed", default.message or "passed")


def check_engine_and_memory(workdir: str) -> None:
    import torch

    from engine_ref import LLM
    from engine_ref.isolation import run_isolated
    from engine_ref.memory.compare import compare_with_report
    from engine_ref.memory.estimate import estimate_memory
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint

    store = Path(tempfile.mkdtemp(dir=workdir)) / "store"
    try:
        value = run_isolated(nccl_all_reduce, str(store), timeout=120)
        report("nccl all-reduces on the GPU", value == 3.0, f"one rank, result {value:g}")
    except Exception as e:  # noqa: BLE001 - any failure is this check's FAIL line, and the next check still runs
        report("nccl all-reduces on the GPU", False, f"{type(e).__name__}: {e}")
    model = make_checkpoint("LlamaForCausalLM", Path(workdir) / "llama", dtype="float16", overrides=MODEL_OVERRIDES)
    start = time.perf_counter()
    try:
        with LLM(str(model), tensor_parallel_size=1, distributed_executor_backend="mp", **ENGINE) as llm:
            tokens = llm.generate([[1, 5, 9, 13]], max_tokens=4, ignore_eos=True)
            startup = llm.startup_report
        worker = startup.workers[0]
        report("the engine starts on cuda at TP=1 (mp worker)",
               worker.device.startswith("cuda") and len(tokens[0]) == 4,
               f"device {worker.device}, pid {worker.pid}, {time.perf_counter() - start:.1f} s, tokens {tokens[0]}")
    except Exception as e:  # noqa: BLE001 - any failure is this check's FAIL line
        report("the engine starts on cuda at TP=1 (mp worker)", False, f"{type(e).__name__}: {e}")
        return
    estimate = estimate_memory(model, tensor_parallel_size=1, **{k: ENGINE[k] for k in (
        "device_memory", "max_model_len", "max_num_batched_tokens", "dtype")})
    measured = worker.memory.activation_peak
    comparison = compare_with_report(estimate, startup, activation_rtol=ACTIVATION_RTOL,
                                     activation_atol=ACTIVATION_ATOL)
    report(f"torch.cuda accounting == estimate (weights/buffers exact, activations within "
           f"{ACTIVATION_RTOL:.0%} + {ACTIVATION_ATOL // 1024**2} MiB)", comparison.ok,
           f"{comparison.describe()}; measured {worker.memory.describe()}, activation peak {measured} B")
    if torch.cuda.device_count() >= 2:
        try:
            with LLM(str(model), tensor_parallel_size=2, **ENGINE) as llm:
                tp2 = llm.generate([[1, 5, 9, 13]], max_tokens=4, ignore_eos=True)
            report("the engine at TP=2 over nccl matches TP=1", tp2 == tokens, f"tokens {tp2[0]} vs {tokens[0]}")
        except Exception as e:  # noqa: BLE001 - any failure is this check's FAIL line
            report("the engine at TP=2 over nccl matches TP=1", False, f"{type(e).__name__}: {e}")


def main() -> int:
    reason = no_cuda_reason()
    if reason is not None:
        print(f"SKIP: no CUDA device ({reason})")
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        zoo = Path(workdir) / "gpu_check_zoo"
        zoo.mkdir()
        (zoo / "__init__.py").write_text(f"MODELS = {MODELS!r}\n")
        for name, source in ZOO.items():
            (zoo / name).write_text(source)
        sys.path.insert(0, workdir)  # before the warm parent starts: its children import the zoo
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [workdir, os.environ.get("PYTHONPATH")]))
        check_guard(workdir)
        check_strict(workdir)
        check_engine_and_memory(workdir)
    print(f"{'FAILED' if failures else 'OK'}: {len(failures)} failed, in {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
