"""vLLM's own engine on CPU ranks, started from the warm process or the way vLLM starts it by default.

- ``warm`` (default): every start forks its ranks from this process, which itself never runs an engine
  (a process that ran vLLM's CPU engine deadlocks the torch ops of a later fork, so a check that starts
  vLLM several times, as the TP diagnosis does, must never run one in-process). TP=1 is one fork running
  vLLM's engine core in-process there (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor); TP=N
  forks N ranks, each an engine of vLLM's ``external_launcher`` executor (vLLM's torchrun-style mode: every
  rank runs the same deterministic scheduler and its own worker, joined by torch.distributed over gloo).
  Nothing re-imports vLLM.
- ``spawn``: vLLM's defaults, an engine-core process and (TP>1) MultiprocExecutor workers, which
  vLLM's CPU platform always starts by spawn (``VLLM_WORKER_MULTIPROC_METHOD=spawn`` is forced in
  ``CpuPlatform.check_and_update_config``), so each re-imports vLLM. Kept for fidelity and the benchmark.

Every start returns the greedy tokens of fixed prompt token ids, the top-``LOGPROBS`` log-probabilities vLLM
computed at every position (each prompt token's and each generated token's), vLLM's per-rank memory figures and
phase timings, and shuts the engine down; a failure is an EngineStartError naming phase and rank.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from pytest_enginecheck.vllm_adapter.env import cpu_engine_env
from pytest_enginecheck.vllm_adapter.failures import EngineFailure, classify
from pytest_enginecheck.vllm_adapter.probe import VllmUnavailable, logprobs_api

START_MODES = ("warm", "spawn")
MAX_MODEL_LEN = 128
MAX_TOKENS = 6
LOGPROBS = 20  # top-k log-probabilities per position: vLLM's default max_logprobs, so no engine argument changes
ENGINE_ARGS: dict[str, Any] = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32",
                               "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4,
                               "max_num_batched_tokens": MAX_MODEL_LEN, "seed": 0}


class EngineStartError(Exception):
    """vLLM failed to start, generate or stop on some rank; ``failure`` says where."""

    def __init__(self, failure: EngineFailure, message: str) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass
class EngineRun:
    """One start of vLLM's engine: what it generated, what each rank held, how long each step took."""

    tp: int
    mode: str
    tokens: list[list[int]]
    memory: list[dict[str, Any]]
    seconds: dict[str, float] = field(default_factory=dict)
    captures: list[Any] = field(default_factory=list)  # per rank, a start with capture_prompt (diagnosis.py)
    # Per prompt, per position of prompt + generated tokens from position 1 on: {token id: log-probability} of
    # the top LOGPROBS tokens and the actual one (ids as strings: a run is cached as JSON). Empty: not asked.
    logprobs: list[list[dict[str, float]]] = field(default_factory=list)
    logprobs_unavailable: str = ""  # why vLLM gave none (probe.logprobs_api), when it did not


def prompts(vocab_size: int) -> list[list[int]]:
    """Three fixed prompts of different lengths inside the vocabulary."""
    return [[(7 * i + 3) % vocab_size for i in range(n)] for n in (3, 8, 17)]


def vocab_size(ckpt: str) -> int:
    """The checkpoint's vocab_size (a composite config's text_config's)."""
    import json

    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def _logprobs(output: Any) -> list[dict[str, float]]:
    """One RequestOutput's log-probabilities by position: its prompt's (the first token has none), then its tokens'."""
    positions = [*(output.prompt_logprobs or [])[1:], *(output.outputs[0].logprobs or [])]
    return [{str(token): float(lp.logprob) for token, lp in position.items()} for position in positions]


def _capture(llm: Any, prompt: list[int]) -> list[Any]:
    """One prefill of ``prompt`` with every module of each worker's model hooked: each rank's RankCapture."""
    from vllm import SamplingParams

    from pytest_enginecheck.vllm_adapter.diagnosis import collect, install_hooks

    llm.collective_rpc(install_hooks)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return list(llm.collective_rpc(collect))


def _drive(ckpt: str, tp: int, mode: str, rank: int, extra: dict[str, Any],
           capture_prompt: list[int] | None = None) -> EngineRun:
    """Start vLLM's LLM in this process, generate and measure (or capture one forward), shut down."""
    from vllm import LLM, SamplingParams

    from pytest_enginecheck.vllm_adapter.memory import rank_memory

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    try:
        llm = LLM(model=ckpt, tensor_parallel_size=tp, **ENGINE_ARGS, **extra)
    except Exception as e:  # noqa: BLE001 - reported by phase and rank
        raise EngineStartError(classify(e, rank), str(e)) from None
    seconds["start"] = time.perf_counter() - start
    try:
        if capture_prompt is not None:
            return EngineRun(tp, mode, [], [], seconds, captures=_capture(llm, capture_prompt))
        mark = time.perf_counter()
        asked: dict[str, Any] = {}
        unavailable = ""
        try:
            logprobs_api()
            asked = {"logprobs": LOGPROBS, "prompt_logprobs": LOGPROBS}
        except VllmUnavailable as e:
            unavailable = str(e)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **asked)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab_size(ckpt))], params,
                               use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [_logprobs(o) for o in outputs] if asked else []
        seconds["generate"] = time.perf_counter() - mark
        memory = llm.collective_rpc(rank_memory)
    except Exception as e:  # noqa: BLE001
        raise EngineStartError(classify(e, rank), str(e)) from None
    finally:
        mark = time.perf_counter()
        shutdown(llm)
        seconds["shutdown"] = time.perf_counter() - mark
    return EngineRun(tp, mode, tokens, memory, seconds, logprobs=logprobs, logprobs_unavailable=unavailable)


def shutdown(llm: Any) -> None:
    """Stop vLLM's engine core (and its processes) and this process's distributed state."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    from vllm.distributed import parallel_state

    cleanup = getattr(parallel_state, "cleanup_dist_env_and_memory", None)
    if cleanup is not None:
        cleanup()


def _rank_main(ckpt: str, tp: int, rank: int, port: int, ipc_dir: str,
               conn: multiprocessing.connection.Connection, capture_prompt: list[int] | None = None) -> None:
    import cloudpickle

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_RPC_BASE_PATH=ipc_dir)
    try:
        extra = {"distributed_executor_backend": "external_launcher"} if tp > 1 else {}
        outcome: tuple = ("ok", _drive(ckpt, tp, "warm", rank, extra, capture_prompt))
    except EngineStartError as e:
        outcome = ("error", e.failure, str(e))
    except BaseException as e:  # noqa: BLE001 - anything else of this rank
        outcome = ("error", classify(e, rank), str(e))
    conn.send_bytes(cloudpickle.dumps(outcome))
    conn.close()


def _run_ranks(ckpt: str, tp: int, timeout: float, capture_prompt: list[int] | None = None) -> EngineRun:
    import cloudpickle
    from vllm.utils.network_utils import get_open_port

    from engine_ref.isolation import describe_exitcode, start_process

    ctx = multiprocessing.get_context("fork")  # forks of this (warm, CUDA-free) process
    port = get_open_port()
    # vLLM's shared-memory broadcast binds ZeroMQ IPC files here; a forked rank leaves by os._exit, which
    # never closes them (a normal interpreter exit would), so the directory goes with the ranks.
    ipc_dir = tempfile.mkdtemp(prefix="vllm-ipc-")
    ranks = []
    for rank in range(tp):
        reader, writer = ctx.Pipe(duplex=False)
        ranks.append((rank, start_process(_rank_main, ckpt, tp, rank, port, ipc_dir, writer, capture_prompt,
                                          name=f"vllm-rank-{rank}", ctx=ctx), reader))
        writer.close()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < tp:
            pending = {reader: (rank, proc) for rank, proc, reader in ranks if rank not in results}
            ready = multiprocessing.connection.wait([*pending, *(p.sentinel for _, p in pending.values())],
                                                    timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                rank, proc = next(iter(pending.values()))
                stacks = proc.dump_stacks()
                failure = EngineFailure("timeout", rank, f"no result within {timeout:g} s", "", stacks)
                raise EngineStartError(failure, f"rank {rank} did not finish within {timeout:g} s:\n{stacks}")
            for reader, (rank, proc) in pending.items():
                if reader in ready or reader.poll():
                    try:
                        results[rank] = cloudpickle.loads(reader.recv_bytes())
                    except EOFError:
                        results[rank] = ("died", proc)
                elif proc.sentinel in ready:
                    results[rank] = ("died", proc)
            errors = [(r, o) for r, o in sorted(results.items()) if o[0] != "ok"]
            if errors:
                rank, outcome = errors[0]
                if outcome[0] == "error":
                    raise EngineStartError(outcome[1], outcome[2])
                outcome[1].join(1)
                what = describe_exitcode(outcome[1].exitcode)
                raise EngineStartError(EngineFailure("startup", rank, f"the rank process {what}", "", ""),
                                       f"rank {rank} {what} before returning a result")
    finally:
        for _, proc, reader in ranks:
            proc.close(grace_s=10.0)
            reader.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
    runs = [results[rank][1] for rank in range(tp)]
    run = runs[0]
    run.memory = [m for r in runs for m in r.memory]
    run.captures = [c for r in runs for c in r.captures]
    run.seconds = {k: max(r.seconds.get(k, 0.0) for r in runs) for k in run.seconds}
    return run


def run_engine(ckpt: str, tp: int, mode: str = "warm", timeout: float = 300.0,
               capture_prompt: list[int] | None = None) -> EngineRun:
    """Start vLLM on ``ckpt`` at ``tp`` ranks (see the module docstring), generate, measure, stop.

    With ``capture_prompt``, instead of generating and measuring: one prefill of that prompt with every module
    hooked (the TP diagnosis), each rank's capture in ``EngineRun.captures``."""
    if mode not in START_MODES:
        raise ValueError(f"mode={mode!r}: use one of {', '.join(START_MODES)}")
    os.environ.update(cpu_engine_env(tp))
    start = time.perf_counter()
    if mode == "spawn":
        # collective_rpc ships rank_memory (a function) to the engine-core process: vLLM's opt-in for pickling it.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        run = _drive(ckpt, tp, mode, 0, {}, capture_prompt)
    else:
        run = _run_ranks(ckpt, tp, timeout, capture_prompt)
    run.seconds["total"] = time.perf_counter() - start
    return run
