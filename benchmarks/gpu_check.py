"""What CPU CI cannot prove, checked on a real CUDA machine (a few minutes on one GPU).

NOT YET RUN ON HARDWARE: written and reviewed by reading; on a machine without a CUDA device it prints
``SKIP: no CUDA device`` and exits 0 (what CI runs). What each line proves when it PASSes:

1. guard: the import check (a fork of the warm parent, CUDA guard on) catches a module that calls
   ``torch.cuda.get_device_properties`` at import, on a CUDA build with a GPU present, naming the
   API and the line; afterwards a clean module's check passes, a fresh fork still uses CUDA, and this
   process never initialized CUDA.
2. strict: the strict import check flags a module calling ``torch.cuda.is_available()`` at import;
   the default one lets it pass.
3. nccl: a world_size=1 nccl process group initializes and runs an all-reduce kernel on the GPU. It proves
   NCCL loads and runs here, not that ranks exchange data: the engine at TP=1 has no process group
   (``init_distributed_environment`` forms none for one rank), so nothing else at TP=1 touches nccl.
4. engine: an engine_ref engine starts on ``cuda`` at TP=1 in a worker process (the mp executor, a fork
   of the warm parent), generates, and shuts down. TP=2 (the engine over nccl across two GPUs, its tokens
   equal to TP=1's) runs only when two GPUs are visible; with one it prints ``SKIP TP=2 (1 GPU)``.
5. memory, each figure measured by torch.cuda in the engine's own Worker (driven as the uni executor drives
   it) against the meta-device estimate:
   - weights and buffers: the ``torch.cuda.memory_allocated()`` change around ``load_model`` equals the
     estimate's weight + buffer bytes, up to the allocator's 512-byte rounding per tensor (not the storage
     bytes of the loaded tensors, which equal the estimate by construction);
   - activations: the profile batch (``max_num_batched_tokens``) is sized so that its estimated peak is at
     least MIN_ACTIVATION_ESTIMATE (256 MiB); the peak the profile run measures (torch.cuda's
     ``max_memory_allocated`` above what was allocated before it) is within ACTIVATION_RTOL (10 %) of that
     estimate, with no absolute allowance. cuBLAS's workspace (allocated once per process at the first
     matmul, through the caching allocator, and not modelled by the estimate) is created before the
     profile run, and its size is printed.
   The KV cache is not compared.

    python benchmarks/gpu_check.py

Prints one line per check (PASS, FAIL or SKIP) and exits 1 if any fails. This process never initializes CUDA
itself: every CUDA call runs in a child, so the forks that follow it stay valid.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask NVML, not cuInit, whether a GPU is there

ACTIVATION_RTOL = 0.10  # of the estimate, with no absolute allowance
MIN_ACTIVATION_ESTIMATE = 256 * 1024**2  # the profile batch is sized so its estimated peak is at least this
ALLOCATOR_ROUNDING = 512  # bytes: the caching allocator rounds every block up to a multiple of it
# max_num_batched_tokens is added by profile_batch().
ENGINE: dict[str, Any] = {"device": "cuda", "device_memory": "4GiB", "max_model_len": 512, "dtype": "float16"}
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
    from pytest_enginecheck.settings import Settings

    module, class_name = MODELS[arch].split(":")
    return run_check(CheckContext(check="import", spec="gpu_check_zoo:MODELS", architecture=arch, module=module,
                                  class_name=class_name, workdir=workdir,
                                  options=Settings(strict=strict, timeout=120.0)))


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


def check_nccl(workdir: str) -> None:
    from engine_ref.isolation import run_isolated

    store = Path(tempfile.mkdtemp(dir=workdir)) / "store"
    name = "nccl initializes and all-reduces on the GPU (a world_size=1 group: no traffic between GPUs)"
    try:
        value = run_isolated(nccl_all_reduce, str(store), timeout=120)
        report(name, value == 3.0, f"one rank, result {value:g}")
    except Exception as e:  # noqa: BLE001 - any failure is this check's FAIL line, and the next check still runs
        report(name, False, f"{type(e).__name__}: {e}")


def profile_batch(model: Path) -> tuple[int, Any]:
    """The smallest max_num_batched_tokens (a multiple of max_model_len) whose estimated activation peak at TP=1
    is at least MIN_ACTIVATION_ESTIMATE, and that estimate (meta device: no CUDA here)."""
    from engine_ref.memory.estimate import estimate_memory

    def estimate(tokens: int) -> Any:
        return estimate_memory(model, tensor_parallel_size=1, max_num_batched_tokens=tokens, **estimate_args())

    step = ENGINE["max_model_len"]
    first = estimate(step)
    per_token = max(1, first.activation_peak_bytes_per_rank[0] // step)
    tokens = max(step, -(-MIN_ACTIVATION_ESTIMATE // per_token // step) * step)
    found = estimate(tokens)
    while found.activation_peak_bytes_per_rank[0] < MIN_ACTIVATION_ESTIMATE:
        tokens += step
        found = estimate(tokens)
    return tokens, found


def estimate_args() -> dict[str, Any]:
    """ENGINE's arguments that estimate_memory takes too."""
    return {k: ENGINE[k] for k in ("device_memory", "max_model_len", "dtype")}


def measure_worker(model: str, engine: dict[str, Any]) -> dict[str, int]:
    """In a child: one TP=1 Worker on cuda, driven as the uni executor drives it, with torch.cuda's own count of
    what ``load_model`` allocated and the activation peak the worker's profile run measures."""
    import torch

    from engine_ref.engine.arg_utils import EngineArgs
    from engine_ref.worker.worker import Worker

    worker = Worker(EngineArgs(model=model, tensor_parallel_size=1, **engine).create_engine_config(), rank=0)
    try:
        worker.init_device()
        device = worker.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        worker.load_model()
        torch.cuda.synchronize(device)
        loaded = torch.cuda.memory_allocated(device) - before
        assert worker.model is not None
        tensors = len(list(worker.model.parameters())) + len(list(worker.model.buffers()))
        # cuBLAS allocates its workspace through the caching allocator at the first matmul (and cuBLASLt's at
        # the first one with a bias) and keeps it: create it here, outside the profile run's window.
        before = torch.cuda.memory_allocated(device)
        a = torch.ones(64, 64, device=device, dtype=torch.float16)
        torch.mm(a, a), torch.nn.functional.linear(a, a, a[0])  # their outputs are freed at once
        del a
        torch.cuda.synchronize(device)
        workspace = torch.cuda.memory_allocated(device) - before
        worker.determine_available_memory()
        return {"loaded": loaded, "tensors": tensors, "workspace": workspace,
                "activation_peak": worker.memory.activation_peak}
    finally:
        worker.shutdown()


def check_engine(model: Path) -> None:
    import torch

    from engine_ref import LLM

    name = "the engine starts on cuda at TP=1 (mp worker), generates and shuts down"
    start = time.perf_counter()
    try:
        with LLM(str(model), tensor_parallel_size=1, distributed_executor_backend="mp", **ENGINE) as llm:
            tokens = llm.generate([[1, 5, 9, 13]], max_tokens=4, ignore_eos=True)
            worker = llm.startup_report.workers[0]
        report(name, worker.device.startswith("cuda") and len(tokens[0]) == 4,
               f"device {worker.device}, pid {worker.pid}, {time.perf_counter() - start:.1f} s, tokens {tokens[0]}")
    except Exception as e:  # noqa: BLE001 - any failure is this check's FAIL line
        report(name, False, f"{type(e).__name__}: {e}")
        return
    gpus = torch.cuda.device_count()  # NVML-based (see above): does not initialize CUDA here
    if gpus < 2:
        print(f"SKIP TP=2 (1 GPU): the engine at TP=2 over nccl needs two GPUs; {gpus} visible", flush=True)
        return
    try:
        with LLM(str(model), tensor_parallel_size=2, **ENGINE) as llm:
            tp2 = llm.generate([[1, 5, 9, 13]], max_tokens=4, ignore_eos=True)
        report("the engine at TP=2 over nccl matches TP=1", tp2 == tokens, f"tokens {tp2[0]} vs {tokens[0]}")
    except Exception as e:  # noqa: BLE001 - any failure is this check's FAIL line
        report("the engine at TP=2 over nccl matches TP=1", False, f"{type(e).__name__}: {e}")


def check_memory(model: Path, estimate: Any) -> None:
    from engine_ref.isolation import run_isolated

    mib = 1024**2
    try:
        measured = run_isolated(measure_worker, str(model), ENGINE, timeout=300)
    except Exception as e:  # noqa: BLE001 - any failure is this check's FAIL line
        report("torch.cuda measures what the estimate predicts", False, f"{type(e).__name__}: {e}")
        return
    expected = estimate.weight_bytes_per_rank[0] + estimate.buffer_bytes_per_rank[0]
    slack = ALLOCATOR_ROUNDING * measured["tensors"]
    report("weights + buffers: torch.cuda.memory_allocated() change around load_model == estimate",
           0 <= measured["loaded"] - expected <= slack,
           f"allocated {measured['loaded']} B, estimated {expected} B ({measured['loaded'] - expected:+d} B; "
           f"allowed 0..{slack} B: {ALLOCATOR_ROUNDING} B of rounding for each of {measured['tensors']} tensors)")
    peak, predicted = measured["activation_peak"], estimate.activation_peak_bytes_per_rank[0]
    report(f"activation peak of the profile run (max_num_batched_tokens={ENGINE['max_num_batched_tokens']}) "
           f"within {ACTIVATION_RTOL:.0%} of the estimate", abs(peak - predicted) <= ACTIVATION_RTOL * predicted,
           f"measured {peak / mib:.1f} MiB, estimated {predicted / mib:.1f} MiB "
           f"({(peak - predicted) / predicted:+.1%}); cuBLAS workspace created before it: "
           f"{measured['workspace'] / mib:.1f} MiB")


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
        check_nccl(workdir)
        from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint

        model = make_checkpoint("LlamaForCausalLM", Path(workdir) / "llama", dtype="float16",
                                overrides=MODEL_OVERRIDES)
        ENGINE["max_num_batched_tokens"], estimate = profile_batch(model)
        check_engine(model)
        check_memory(model, estimate)
    print(f"{'FAILED' if failures else 'OK'}: {len(failures)} failed, in {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
