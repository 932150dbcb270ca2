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
phase timings, and shuts the engine down; a failure is an EngineStartError naming phase and rank. The warm ranks
are waited for under one deadline (``engine_ref.isolation``'s ``AnswerWait``): at the deadline every rank still
running has its Python stacks in the failure and is killed; a rank that died is named by its exit; the ranks'
exit after their answers shares one grace (SHUTDOWN_GRACE_S). What the engine calls of vLLM comes from the probe
(``probe.engine_api``), so a vLLM without it ends in VllmUnavailable before any rank starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_enginecheck.targets.vllm.composite import engine_args as text_only_args
from pytest_enginecheck.targets.vllm.env import cpu_engine_env
from pytest_enginecheck.targets.vllm.failures import EngineFailure, classify
from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, engine_api, logprobs_api, model_initializer

if TYPE_CHECKING:
    from engine_ref.isolation import AnswerWait, Deadline, WarmProcess

START_MODES = ("warm", "spawn")
MAX_MODEL_LEN = 128
MAX_TOKENS = 6
LOGPROBS = 20  # top-k log-probabilities per position: vLLM's default max_logprobs, so no engine argument changes
SHUTDOWN_GRACE_S = 10.0  # for all ranks together, from the last answer: how long they may take to exit by themselves
SHM_DIR = "/dev/shm"
SHM_MARK = "-cpushm"  # in the names of vLLM's CpuCommunicator's shared-memory all-reduce segments (_CPUSHMDistributed)
# vLLM's CPU all-reduce names its shared memory by TP rank alone (``-tp:0-[0-1]-cpushm_N``): two engines of TP>1 on one
# machine at once collide ("create shm in SHMManager failed. errno: 17"), so they take turns on this lock.
MULTIRANK_LOCK = "/tmp/pytest-enginecheck-vllm-multirank.lock"
FAILURE_GRACE_S = 2.0  # after a rank failed: how long the others may take to fail too (the first death is the cause)
# engine_args' key (not an argument of LLM) naming a PEFT adapter directory: that start generates the prompts without
# the adapter and again with it (EngineRun.lora_tokens); its LoRA arguments (enable_lora, ...) are the caller's.
LORA_ADAPTER = "enginecheck_lora_adapter"
# engine_args' key (not an argument of LLM) naming a function run on every worker (``collective_rpc``) after the
# generation: each rank's result in EngineRun.captures (the quant check's local products, quant.py).
WORKER_RPC = "enginecheck_worker_rpc"
ENGINE_ARGS: dict[str, Any] = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32",
                               "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4,
                               "max_num_batched_tokens": MAX_MODEL_LEN, "seed": 0}


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
    from pytest_enginecheck.targets.vllm.memory import _built_model
    from pytest_enginecheck.targets.vllm.probe import model_initializer
    from pytest_enginecheck.targets.vllm.vllm_weights import _vllm_model

    with _vllm_model(ckpt) as build:
        model = _built_model(model_initializer(), build.vllm_config, "meta")
    return any(cls.__name__ == "MLAAttention" for module in model.modules() for cls in type(module).__mro__)


def builds_mla(ckpt: str) -> bool:
    """Whether vLLM's model of the checkpoint at ``ckpt`` has MLA attention though ``ModelConfig.use_mla`` says no
    (SarvamMLA builds vLLM's MultiHeadLatentAttentionWrapper in every layer, and vLLM's list of MLA model types has
    not its ``sarvam_mla``, the hub checkpoints' too): where the model class's modules refer to vLLM's MLA layers, its
    model is built on the meta device (in a fork, about 5 s) and looked through. False where it cannot be built: the
    engine start that builds the same model gives the verdict."""
    import json

    from engine_ref.isolation import run_isolated
    from pytest_enginecheck.targets.vllm.registry import import_model_class, list_architectures

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


def checkpoint_args(ckpt: str) -> dict[str, Any]:
    """vLLM's arguments the checkpoint at ``ckpt`` needs: a composite one's text decoder alone
    (``composite.engine_args``), ``trust_remote_code`` for one whose config is the checker's remote config
    (``remote_config.engine_args``), ``skip_tokenizer_init=False`` for one with the checker's tokenizer
    (``tokenizer.engine_args``)."""
    from pytest_enginecheck.targets.vllm import remote_config, tokenizer

    return {**text_only_args(ckpt), **remote_config.engine_args(ckpt), **tokenizer.engine_args(ckpt)}


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
    # A start with a LoRA adapter (engine_args[LORA_ADAPTER]): the same prompts' tokens and log-probabilities with
    # the adapter; ``tokens`` and ``logprobs`` are then the base model's from the same engine.
    lora_tokens: list[list[int]] = field(default_factory=list)
    lora_logprobs: list[list[dict[str, float]]] = field(default_factory=list)


def prompts(vocab_size: int) -> list[list[int]]:
    """Three fixed prompts of different lengths inside the vocabulary."""
    return [[(7 * i + 3) % vocab_size for i in range(n)] for n in (3, 8, 17)]


def vocab_size(ckpt: str) -> int:
    """The checkpoint's vocab_size: its config.json's top-level one, else the smallest of its sub-configs' (a
    composite config's ``text_config``, BagelConfig's ``llm_config``), which every prompt token then lies inside."""
    import json

    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    return int(config.get("vocab_size") or min(_nested_vocab_sizes(config)))


def _nested_vocab_sizes(config: dict[str, Any]) -> list[int]:
    """The ``vocab_size`` of every dict inside ``config``, at any depth."""
    found = []
    for value in config.values():
        if isinstance(value, dict):
            found += [value["vocab_size"]] if isinstance(value.get("vocab_size"), int) else []
            found += _nested_vocab_sizes(value)
    return found


def _logprobs(output: Any) -> list[dict[str, float]]:
    """One RequestOutput's log-probabilities by position: its prompt's (the first token has none), then its tokens'."""
    positions = [*(output.prompt_logprobs or [])[1:], *(output.outputs[0].logprobs or [])]
    return [{str(token): float(lp.logprob) for token, lp in position.items()} for position in positions]


def _capture(llm: Any, prompt: list[int]) -> list[Any]:
    """One prefill of ``prompt`` with every module of each worker's model hooked: each rank's RankCapture."""
    from pytest_enginecheck.targets.vllm.diagnosis import collect, install_hooks

    llm.collective_rpc(install_hooks)
    llm.generate([{"prompt_token_ids": prompt}], engine_api().sampling_params(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    return list(llm.collective_rpc(collect))


def _drive(ckpt: str, tp: int, mode: str, rank: int, extra: dict[str, Any],
           capture_prompt: list[int] | None = None) -> EngineRun:
    """Start vLLM's LLM in this process, generate and measure (or capture one forward), shut down."""
    from pytest_enginecheck.targets.vllm.memory import rank_memory

    api = engine_api()
    extra = dict(extra)
    adapter = extra.pop(LORA_ADAPTER, None)
    rpc = extra.pop(WORKER_RPC, None)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    try:
        # extra may set the dtype; what the checkpoint needs (checkpoint_args): a composite's text decoder alone, ...
        llm = api.llm(model=ckpt, tensor_parallel_size=tp, **{**ENGINE_ARGS, **checkpoint_args(ckpt), **extra})
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
            # vLLM 0.32's CPU LoRA logits path fails on prompt log-probabilities (LogitsProcessorWithLoRA sizes its
            # indices by request, the prompt's logits by token): with an adapter, the generated tokens' only.
            asked = {"logprobs": LOGPROBS, **({} if adapter else {"prompt_logprobs": LOGPROBS})}
        except VllmUnavailable as e:
            unavailable = str(e)
        params = api.sampling_params(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **asked)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab_size(ckpt))], params,
                               use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [_logprobs(o) for o in outputs] if asked else []
        lora_tokens, lora_logprobs = _generate_with_lora(llm, ckpt, params, adapter) if adapter else ([], [])
        seconds["generate"] = time.perf_counter() - mark
        memory = llm.collective_rpc(rank_memory)
        captures = list(llm.collective_rpc(rpc)) if rpc is not None else []
    except Exception as e:  # noqa: BLE001
        raise EngineStartError(classify(e, rank), str(e)) from None
    finally:
        mark = time.perf_counter()
        shutdown(llm)
        seconds["shutdown"] = time.perf_counter() - mark
    return EngineRun(tp, mode, tokens, memory, seconds, captures=captures, logprobs=logprobs,
                     logprobs_unavailable=unavailable, lora_tokens=lora_tokens,
                     lora_logprobs=lora_logprobs if asked else [])


def _generate_with_lora(llm: Any, ckpt: str, params: Any, adapter: str) -> tuple[list[list[int]], list[Any]]:
    """The fixed prompts' greedy tokens and log-probabilities with the PEFT adapter at ``adapter`` (a LoRARequest)."""
    from pytest_enginecheck.targets.vllm.lora import lora_request

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab_size(ckpt))], params, use_tqdm=False,
                           lora_request=lora_request(adapter))
    return [list(o.outputs[0].token_ids) for o in outputs], [_logprobs(o) for o in outputs]


def shutdown(llm: Any) -> None:
    """Stop vLLM's engine core (and its processes) and this process's distributed state."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    cleanup = engine_api().cleanup
    if cleanup is not None:
        cleanup()


def _rank_main(ckpt: str, tp: int, rank: int, port: int, ipc_dir: str,
               conn: multiprocessing.connection.Connection, capture_prompt: list[int] | None = None,
               engine_args: dict[str, Any] | None = None) -> None:
    import cloudpickle

    from pytest_enginecheck.targets.vllm.ranklog import capture_output

    capture_output(_rank_log(ipc_dir, rank))  # _fork_ranks passes on what of it is about the outcome
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_RPC_BASE_PATH=ipc_dir)
    try:
        extra = {"distributed_executor_backend": "external_launcher"} if tp > 1 else {}
        extra.update(engine_args or {})
        outcome: tuple = ("ok", _drive(ckpt, tp, "warm", rank, extra, capture_prompt))
    except EngineStartError as e:
        outcome = ("error", e.failure, str(e))
    except BaseException as e:  # noqa: BLE001 - anything else of this rank
        outcome = ("error", classify(e, rank), str(e))
    conn.send_bytes(cloudpickle.dumps(outcome))
    conn.close()


def _rank_log(ipc_dir: str, rank: int) -> str:
    return os.path.join(ipc_dir, f"rank-{rank}.log")


def _relay_rank_logs(ipc_dir: str, ranks: range, failed: set[int]) -> None:
    """Write each rank's output, trimmed to what is about the outcome (``ranklog.trimmed_log``), to stderr."""
    import sys

    from pytest_enginecheck.targets.vllm.ranklog import trimmed_log

    for rank in ranks:
        try:
            with open(_rank_log(ipc_dir, rank), errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        sys.stderr.write(trimmed_log(text, rank in failed, f"vllm-rank-{rank}"))
    sys.stderr.flush()


def _gather(wait: AnswerWait[int], procs: dict[int, WarmProcess], timeout: float) -> list[EngineRun]:
    """Every rank's EngineRun in rank order; EngineStartError for the first rank that failed or died (a death
    wins over the errors that arrive within FAILURE_GRACE_S of it: its peers fail because it is gone), or for
    the ranks still running at the deadline, with all their stacks."""
    import cloudpickle

    from engine_ref.isolation import describe_exitcode

    runs: dict[int, EngineRun] = {}
    deaths: list[EngineStartError] = []
    errors: list[EngineStartError] = []
    for rank, message in wait:
        if message is None:  # it ended without a word
            procs[rank].join(1.0)
            what = describe_exitcode(procs[rank].exitcode)
            deaths.append(EngineStartError(EngineFailure("startup", rank, f"the rank process {what}", "", ""),
                                           f"rank {rank} {what} before returning a result"))
        else:
            outcome = cloudpickle.loads(message)
            if outcome[0] == "ok":
                runs[rank] = outcome[1]
                continue
            errors.append(EngineStartError(outcome[1], outcome[2]))
        wait.deadline.shorten(FAILURE_GRACE_S)
    if deaths or errors:
        for rank in wait.pending:  # waiting in a collective for a rank that failed: they cannot finish
            procs[rank].kill_tree()
        raise (deaths or errors)[0]
    if wait.pending:
        raise _timed_out(sorted(wait.pending), procs, timeout)
    return [runs[rank] for rank in sorted(runs)]


def _timed_out(pending: list[int], procs: dict[int, WarmProcess], timeout: float) -> EngineStartError:
    """The failure of the ranks that gave no result by the deadline: every one's Python stacks, then each killed."""
    stacks = {}
    for rank in pending:
        stacks[rank] = procs[rank].dump_stacks() or "(none could be read)"
        procs[rank].kill_tree()
    told = "\n".join(f"rank {rank}:\n{text.rstrip()}" for rank, text in stacks.items())
    ranks = ", ".join(str(rank) for rank in pending)
    failure = EngineFailure("timeout", pending[0], f"rank {ranks} gave no result within {timeout:g} s", "", told)
    return EngineStartError(failure, f"rank {ranks} did not finish within {timeout:g} s; their Python stacks at "
                                     f"that moment:\n{told}")


def _close_ranks(procs: dict[int, WarmProcess], grace: Deadline) -> None:
    """Give the ranks, all together, until ``grace`` to exit by themselves, then kill the rest (and what they
    started) and reap them all."""
    for proc in procs.values():
        proc.join(grace.remaining())
    for proc in procs.values():
        proc.close()


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _remove_left_shm(before: set[str]) -> None:
    """Unlink vLLM's CPU all-reduce segments (``<ident>-tp:0-[0-1]-cpushm_<rank>``) that appeared since ``before``
    and no process holds. vLLM unlinks them in a static destructor, which runs at a normal interpreter exit but
    not when a forked rank leaves by os._exit (nor when it is killed); and it names them alike for every
    external-launcher engine (``VLLM_DIST_IDENT`` comes from the ``env://`` init method), so the next TP=N start
    on this machine would fail with errno 17 (EEXIST) in ``init_device``."""
    from pytest_enginecheck.leaks import unowned_shm_entries

    for name in (_shm_entries() - before) & unowned_shm_entries(set()):
        if SHM_MARK in name:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))


@contextlib.contextmanager
def _short_tmpdir() -> Iterator[None]:
    """TMPDIR (here and in the processes vLLM spawns) a new directory directly in /tmp for the block, removed after:
    vLLM's engine core binds its ZeroMQ IPC sockets in TMPDIR, and a check's private TMPDIR nests past the 107-byte
    limit of a socket's path."""
    path = tempfile.mkdtemp(prefix="vllm-", dir="/tmp" if os.path.isdir("/tmp") else None)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = tempfile.tempdir = path
    try:
        yield
    finally:
        tempfile.tempdir = None
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _one_multirank_engine_at_a_time(deadline: Deadline) -> Iterator[None]:
    """Hold MULTIRANK_LOCK (machine-wide) while a TP>1 engine runs, waiting for it no longer than ``deadline``."""
    fd = os.open(MULTIRANK_LOCK, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline.expired():
                    message = (f"another vLLM engine of tensor_parallel_size>1 ran on this machine for the whole "
                               f"{deadline.seconds:g} s (vLLM's CPU all-reduce names its shared memory by rank, "
                               f"so two cannot run at once; {MULTIRANK_LOCK})")
                    raise EngineStartError(EngineFailure("timeout", 0, message, "", ""), message) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _run_ranks(ckpt: str, tp: int, timeout: float, capture_prompt: list[int] | None = None,
               engine_args: dict[str, Any] | None = None) -> EngineRun:
    """Fork ``tp`` ranks and wait for each one's EngineRun under one deadline (engine_ref.isolation's wait)."""
    from engine_ref.isolation import Deadline

    deadline = Deadline(timeout)
    if tp == 1:
        return _fork_ranks(ckpt, tp, deadline, capture_prompt, engine_args)
    with _one_multirank_engine_at_a_time(deadline):
        # What an engine killed mid-run left (a check's timeout kills its whole tree before _remove_left_shm runs):
        # under the lock no other TP>1 engine of ours runs, so a segment nobody maps is a leftover, not a peer's.
        _remove_left_shm(set())
        return _fork_ranks(ckpt, tp, deadline, capture_prompt, engine_args)


def _fork_ranks(ckpt: str, tp: int, deadline: Deadline, capture_prompt: list[int] | None,
                engine_args: dict[str, Any] | None = None) -> EngineRun:
    """The ranks under ``deadline`` (the start's Deadline; what the lock waited is already spent from it)."""
    from engine_ref.isolation import AnswerWait, Deadline, start_process

    ctx = multiprocessing.get_context("fork")  # forks of this (warm, CUDA-free) process
    port = engine_api().get_open_port()
    # vLLM's shared-memory broadcast binds ZeroMQ IPC files here; a forked rank leaves by os._exit, which
    # never closes them (a normal interpreter exit would), so the directory goes with the ranks.
    ipc_dir = tempfile.mkdtemp(prefix="vllm-ipc-")
    procs: dict[int, WarmProcess] = {}
    readers: dict[int, multiprocessing.connection.Connection] = {}
    shm_before = _shm_entries()
    failed = set(range(tp))  # the ranks whose output is about a failure: all of them, until they answered
    try:
        for rank in range(tp):
            reader, writer = ctx.Pipe(duplex=False)
            readers[rank] = reader
            procs[rank] = start_process(_rank_main, ckpt, tp, rank, port, ipc_dir, writer, capture_prompt,
                                        engine_args, name=f"vllm-rank-{rank}", ctx=ctx)
            writer.close()
        wait = AnswerWait(readers, {rank: proc.sentinel for rank, proc in procs.items()}, deadline)
        runs = _gather(wait, procs, deadline.seconds or 0.0)
        failed = set()
    except EngineStartError as e:
        failed = {e.failure.rank}
        raise
    finally:
        _close_ranks(procs, Deadline(SHUTDOWN_GRACE_S))
        for reader in readers.values():
            reader.close()
        _relay_rank_logs(ipc_dir, range(len(procs)), failed)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        _remove_left_shm(shm_before)
    run = runs[0]
    run.memory = [m for r in runs for m in r.memory]
    run.captures = [c for r in runs for c in r.captures]
    run.seconds = {k: max(r.seconds.get(k, 0.0) for r in runs) for k in run.seconds}
    return run


def run_engine(ckpt: str, tp: int, mode: str = "warm", timeout: float = 300.0,
               capture_prompt: list[int] | None = None, engine_args: dict[str, Any] | None = None) -> EngineRun:
    """Start vLLM on ``ckpt`` at ``tp`` ranks (see the module docstring), generate, measure, stop.

    With ``capture_prompt``, instead of generating and measuring: one prefill of that prompt with every module
    hooked (the TP diagnosis), each rank's capture in ``EngineRun.captures``. ``engine_args``: more of ``LLM``'s
    arguments (the quant check's ``logprobs_mode``), with WORKER_RPC and LORA_ADAPTER."""
    if mode not in START_MODES:
        raise ValueError(f"mode={mode!r}: use one of {', '.join(START_MODES)}")
    engine_api()  # a vLLM without what the engine needs ends here (VllmUnavailable, a skip), not inside a rank
    if capture_prompt is None:
        model_initializer()  # what rank_memory sizes the weights with
    os.environ.update(cpu_engine_env(tp))
    start = time.perf_counter()
    if mode == "spawn":
        # collective_rpc ships rank_memory (a function) to the engine-core process: vLLM's opt-in for pickling it.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        with _short_tmpdir():
            run = _drive(ckpt, tp, mode, 0, dict(engine_args or {}), capture_prompt)
    else:
        run = _run_ranks(ckpt, tp, timeout, capture_prompt, engine_args)
    run.seconds["total"] = time.perf_counter() - start
    return run
