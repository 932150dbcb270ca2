"""The vLLM target's pure parts, tested without vLLM (the project venv has none): failure classification, root
lines, the environment set-up, the tiny-config shrinking rules (``tiny_config`` itself, which imports
transformers, is the vllm tier's), TP verification, the log-probability comparison,
the rank wait (real forked rank processes, no engine in them) and the probe's degradation on fake ``vllm`` trees."""

from __future__ import annotations

import importlib
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckSkip


def _load_file(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_root_line_is_the_last_exception_line_of_a_traceback() -> None:
    from pytest_enginecheck.targets.vllm.describe.registry import root_line

    text = textwrap.dedent('''\
        Traceback (most recent call last):
          File "/x/registry.py", line 12, in _run
            raise RuntimeError("first")
        RuntimeError: first

        During handling of the above exception, another exception occurred:

        Traceback (most recent call last):
          File "/x/model.py", line 3, in <module>
            import flash_attn
        ModuleNotFoundError: No module named 'flash_attn'
          some trailing log line
        ''')
    assert root_line(text) == "ModuleNotFoundError: No module named 'flash_attn'"
    assert root_line("just one line") == "just one line"
    assert root_line("  \n") == ""


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


# --- checkpoints: the tiny-config shrinking rules -------------------------------------------------------------

def test_tiny_sizes_shrink_only_the_fields_a_config_has() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_SIZES, tiny_sizes

    sizes = tiny_sizes({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128, "rope_theta": 1e6})
    assert sizes == {"hidden_size": 64, "num_attention_heads": 2, "head_dim": 32}
    assert sizes["hidden_size"] == sizes["num_attention_heads"] * sizes["head_dim"]
    assert TINY_SIZES["head_dim"] >= 32  # vLLM's CPU attention rejects head_dim 16


def test_tiny_sizes_keep_a_top1_router_top1_and_make_every_layer_full_attention() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_sizes

    top1 = tiny_sizes({"num_local_experts": 16, "num_experts_per_tok": 1})
    assert top1 == {"num_local_experts": 4, "num_experts_per_tok": 1}
    assert tiny_sizes({"num_experts": 64, "num_experts_per_tok": 8})["num_experts_per_tok"] == 2
    assert tiny_sizes({"num_experts_per_tok": None}) == {"num_experts_per_tok": 2}
    layered = tiny_sizes({"num_hidden_layers": 40, "layer_types": ["sliding_attention"] * 40})
    assert layered == {"num_hidden_layers": 2, "layer_types": ["full_attention", "full_attention"]}


# --- checks: TP verification and the log-probability comparison -----------------------------------------------

def _ckpt(tmp_path: Path, **config: Any) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_verify_tp_skips_a_size_the_heads_cannot_be_split_over(tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checks.steps import fits, verify_tp

    ckpt = _ckpt(tmp_path, num_attention_heads=6)
    verify_tp(ckpt, 2)
    verify_tp(ckpt, 3)
    with pytest.raises(CheckSkip, match="num_attention_heads=6 cannot be split over tensor_parallel_size=4"):
        verify_tp(ckpt, 4)
    assert [fits(ckpt, tp) for tp in (1, 2, 4, 6)] == [True, True, False, True]


def test_logprob_difference_is_the_worst_token_both_runs_report_and_where() -> None:
    from pytest_enginecheck.targets.vllm.checks.load import logprob_difference

    reference = [[{"5": -1.0, "7": -2.0}, {"3": -0.5}], [{"1": -0.1}]]
    run = [[{"5": -1.0, "9": -3.0}, {"3": -0.5}], [{"1": -0.1004, "2": -9.0}]]
    difference, prompt, position = logprob_difference(run, reference)
    assert (prompt, position) == (1, 1)  # position 0 predicts nothing: positions count from 1
    assert difference == pytest.approx(4e-4)
    assert logprob_difference(reference, reference) == (0.0, 0, 0)
    with pytest.raises(ValueError):  # a run with other positions than its reference is not comparable
        logprob_difference([[{"5": -1.0}]], reference)


# --- engine: the ranks' one deadline wait (real forked processes, no vLLM in them) ---------------------------

def _answer(conn: Connection) -> None:
    import cloudpickle

    from pytest_enginecheck.targets.vllm.engine.drive import EngineRun

    conn.send_bytes(cloudpickle.dumps(("ok", EngineRun(2, "warm", [[1, 2]], [{"rank": 0}]))))


def _answer_then_linger(conn: Connection) -> None:
    _answer(conn)
    time.sleep(3600)  # e.g. a non-daemon thread of the engine that keeps its rank alive


def _hang_in(conn: Connection) -> None:
    def waiting_for_its_peer() -> None:
        time.sleep(3600)

    waiting_for_its_peer()


def _die(conn: Connection) -> None:
    os._exit(3)


def _fail(conn: Connection) -> None:
    import cloudpickle

    from pytest_enginecheck.targets.vllm.failures import EngineFailure

    conn.send_bytes(cloudpickle.dumps(("error", EngineFailure("load_model", 1, "ValueError: x", "", ""), "x")))


def _wait(*targets: Any, timeout: float, grace_s: float | None = None) -> tuple[Any, float, float]:
    """Start one process per target as the engine starts its ranks, wait for them and close them as it does:
    (what the wait returned or raised, its seconds, the seconds closing the ranks took). None is left running."""
    from engine_ref.isolation import AnswerWait, Deadline, start_process
    from pytest_enginecheck.targets.vllm.engine.ranks import SHUTDOWN_GRACE_S, _close_ranks, _gather

    ctx = multiprocessing.get_context("fork")
    procs, readers = {}, {}
    for rank, target in enumerate(targets):
        readers[rank], writer = ctx.Pipe(duplex=False)
        procs[rank] = start_process(target, writer, name=f"rank-{rank}", ctx=ctx)
        writer.close()
    pids = [p.pid for p in procs.values()]
    started = time.monotonic()
    try:
        outcome: Any = _gather(AnswerWait(readers, {r: p.sentinel for r, p in procs.items()}, Deadline(timeout)),
                               procs, timeout)
    except Exception as e:  # noqa: BLE001 - the outcome under test
        outcome = e
    waited = time.monotonic() - started
    _close_ranks(procs, Deadline(SHUTDOWN_GRACE_S if grace_s is None else grace_s))
    closed = time.monotonic() - started - waited
    for reader in readers.values():
        reader.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return outcome, waited, closed


def test_every_pending_ranks_stacks_at_the_deadline_and_one_bounded_shutdown() -> None:
    from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError

    error, waited, closed = _wait(_answer, _hang_in, _hang_in, timeout=2.0)
    assert isinstance(error, EngineStartError), error
    assert error.failure.phase == "timeout" and error.failure.rank == 1
    assert str(error).startswith("rank 1, 2 did not finish within 2 s; their Python stacks at that moment:")
    for rank in (1, 2):
        stack = str(error).split(f"rank {rank}:\n", 1)[1]
        assert "in waiting_for_its_peer" in stack.split("rank 2:\n")[0]
    assert waited < 2.0 + 2 * 1.5, waited  # the deadline, then each pending rank's stacks (~1 s each at most)
    assert closed < 1.0, closed  # the hung ranks were killed with their stacks: no grace spent on them


def test_a_rank_that_dies_is_named_with_its_exit_and_its_hung_peer_costs_no_grace() -> None:
    from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError
    from pytest_enginecheck.targets.vllm.engine.ranks import FAILURE_GRACE_S

    error, waited, closed = _wait(_hang_in, _die, timeout=60.0)
    assert isinstance(error, EngineStartError), error
    assert str(error) == "rank 1 exited with code 3 before returning a result"
    assert (error.failure.phase, error.failure.rank) == ("startup", 1)
    assert waited < FAILURE_GRACE_S + 5.0, waited
    assert closed < 1.0, closed


def test_a_death_is_the_cause_over_the_error_its_peer_raises_after_it() -> None:
    from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError

    error, _, _ = _wait(_fail, _die, timeout=60.0)
    assert isinstance(error, EngineStartError) and "rank 1 exited with code 3" in str(error), error
    error, _, _ = _wait(_answer, _fail, timeout=60.0)
    assert isinstance(error, EngineStartError) and error.failure.phase == "load_model", error


def test_ranks_that_linger_after_answering_share_one_grace() -> None:
    runs, _, closed = _wait(_answer_then_linger, _answer_then_linger, _answer_then_linger, timeout=60.0, grace_s=1.0)
    assert len(runs) == 3
    assert 1.0 <= closed < 2.0, closed  # one grace for the three of them, not one each


def test_ranks_that_answer_are_gathered_in_rank_order() -> None:
    runs, _, closed = _wait(_answer, _answer, timeout=60.0)
    assert [r.tokens for r in runs] == [[[1, 2]], [[1, 2]]]
    assert closed < 5.0, closed


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_the_all_reduce_segments_a_rank_left_are_unlinked_unless_someone_holds_them() -> None:
    from pytest_enginecheck.targets.vllm.engine.ranks import SHM_DIR, _remove_left_shm, _shm_entries

    before = _shm_entries()
    tag = f"enginecheck-test-{os.getpid()}"
    left, held, other = (os.path.join(SHM_DIR, f"{tag}-{n}") for n in ("tp:0-[0-1]-cpushm_1", "tp:0-[0-1]-cpushm_0",
                                                                        "not-vllms"))
    for path in (left, held, other):
        Path(path).write_bytes(b"x")
    try:
        with open(held, "rb"):  # a running engine's segment (here: open in this process)
            _remove_left_shm(before)
            assert (os.path.exists(left), os.path.exists(held), os.path.exists(other)) == (False, True, True)
    finally:
        for path in (left, held, other):
            if os.path.exists(path):
                os.unlink(path)


# --- probe: a vLLM that lacks what the adapter needs ends in one clear VllmUnavailable ------------------------

FAKE_VLLM = {
    "vllm/__init__.py": '__version__ = "0.0.fake"\n\n\nclass LLM:\n    def collective_rpc(self, fn):\n'
                        '        return []\n\n\nclass SamplingParams:\n'
                        '    def __init__(self, logprobs=None, prompt_logprobs=None):\n        pass\n',
    "vllm/utils/__init__.py": "",
    "vllm/utils/network_utils.py": "def get_open_port():\n    return 12345\n",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/parallel_state.py": "def cleanup_dist_env_and_memory():\n    pass\n",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/model_loader/__init__.py": "",
    "vllm/model_executor/model_loader/utils.py": "def initialize_model(vllm_config, prefix=''):\n    pass\n",
    "vllm/envs.py": "VLLM_PLUGINS = ['clean']\n",
}


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``make(files, drop=())``: a fake ``vllm`` tree (FAKE_VLLM, without ``drop``, plus ``files``) on sys.path,
    with the probe's caches cleared before and after."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("a fake vllm tree stands in for vLLM only where none is installed (the project venv)")
    from pytest_enginecheck.targets.vllm import probe

    cached = [probe.probe, probe.sharding_api, probe.logprobs_api, probe.engine_api, probe.model_initializer]

    def forget() -> None:
        for fn in cached:
            fn.cache_clear()
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
        importlib.invalidate_caches()

    def make(files: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> Path:
        root = tmp_path / "site"
        for name, text in {**FAKE_VLLM, **(files or {})}.items():
            if name not in drop:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_text(text)
        monkeypatch.syspath_prepend(str(root))
        forget()
        return root

    yield make
    forget()


def test_a_complete_fake_vllm_gives_every_api(fake_vllm: Any) -> None:
    from pytest_enginecheck.targets.vllm.probe import allowed_plugins, engine_api, logprobs_api, model_initializer

    fake_vllm()
    api = engine_api()
    assert api.get_open_port() == 12345 and api.cleanup is not None and api.llm.__module__ == "vllm"
    assert model_initializer().__module__ == "vllm.model_executor.model_loader.utils"
    assert allowed_plugins() == ["clean"]
    assert logprobs_api().__name__ == "SamplingParams"


def test_get_open_port_is_found_where_an_older_vllm_kept_it(fake_vllm: Any) -> None:
    from pytest_enginecheck.targets.vllm.probe import engine_api

    fake_vllm({"vllm/utils/__init__.py": "def get_open_port():\n    return 54321\n"},
              drop=("vllm/utils/network_utils.py",))
    assert engine_api().get_open_port() == 54321


def test_a_vllm_without_get_open_port_anywhere_is_one_clear_unavailable(fake_vllm: Any, tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.engine.run import run_engine
    from pytest_enginecheck.targets.vllm.probe import VllmUnavailable

    fake_vllm(drop=("vllm/utils/network_utils.py",))
    with pytest.raises(VllmUnavailable) as raised:
        run_engine(_ckpt(tmp_path, num_attention_heads=2, vocab_size=256), 2)  # before any rank is started
    assert str(raised.value) == (
        "this vLLM has no vllm.utils.network_utils.get_open_port (the module is not importable: No module named "
        "'vllm.utils.network_utils') nor vllm.utils.get_open_port (no such attribute), which the engine checks "
        "(load, budget, startup) start vLLM's engine with (the ranks' process group port)")


def test_a_vllm_whose_llm_has_no_collective_rpc(fake_vllm: Any) -> None:
    from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, engine_api

    fake_vllm({"vllm/__init__.py": "class LLM:\n    pass\n\n\nclass SamplingParams:\n    pass\n"})
    with pytest.raises(VllmUnavailable, match="this vLLM's LLM has no collective_rpc"):
        engine_api()


def test_a_vllm_without_initialize_model(fake_vllm: Any) -> None:
    from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, model_initializer

    fake_vllm(drop=("vllm/model_executor/model_loader/utils.py",))
    with pytest.raises(VllmUnavailable, match=r"no vllm\.model_executor\.model_loader\.utils\.initialize_model "
                                              r"\(the module is not importable.*the budget check"):
        model_initializer()


def test_a_vllm_without_its_registry_or_the_logprob_fields(fake_vllm: Any) -> None:
    from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, logprobs_api, probe, sharding_api

    fake_vllm({"vllm/__init__.py": "class SamplingParams:\n    def __init__(self, logprobs=None):\n        pass\n"})
    with pytest.raises(VllmUnavailable, match=r"^vLLM is not importable here \(No module named "
                                              r"'vllm.model_executor.models'\)"):
        probe()
    with pytest.raises(VllmUnavailable, match="SamplingParams has no prompt_logprobs"):
        logprobs_api()
    with pytest.raises(VllmUnavailable, match="parallel layers are not importable"):
        sharding_api()


def test_the_checks_turn_a_missing_api_into_a_skip_that_names_it(fake_vllm: Any, tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checks import skips_unavailable
    from pytest_enginecheck.targets.vllm.probe import engine_api

    fake_vllm(drop=("vllm/utils/network_utils.py",))
    ctx = CheckContext(check="load", spec="vllm", architecture="LlamaForCausalLM", module="", class_name="",
                       workdir=str(tmp_path), tp=2)
    with pytest.raises(CheckSkip, match=r"^this vLLM has no vllm\.utils\.network_utils\.get_open_port .*"
                                        r"\(vLLM not installed\)$"):
        skips_unavailable(lambda ctx: {"api": engine_api()})(ctx)


def test_importing_the_targets_modules_imports_no_engine() -> None:
    """Every module of the target (each room's), imported together, imports neither vLLM, torch nor transformers;
    but ``describe.warm``, the warm parent's preload, which imports them on purpose."""
    root = Path(__file__).parents[2] / "pytest_enginecheck" / "targets" / "vllm"
    modules = sorted(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                     for p in root.rglob("*.py") if p.name != "__init__.py" or p.parent != root)
    modules.remove("describe.warm")
    assert {"probe", "describe.registry", "checkpoints.tiny", "engine.run", "checks.load"} <= set(modules)
    code = ("import sys\n" + "".join(f"import pytest_enginecheck.targets.vllm.{m}\n" for m in modules)
            + "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_multirank_engines_take_turns_on_the_machine_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two TP>1 engines at once would collide on vLLM's rank-named shared memory: the second waits for the lock, and
    fails naming it when the first holds it past its deadline. (A lock of its own: a real engine may hold the
    machine's now.)"""
    import fcntl
    import os

    from engine_ref.isolation import Deadline
    from pytest_enginecheck.targets.vllm.engine import ranks
    from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError
    from pytest_enginecheck.targets.vllm.engine.ranks import _one_multirank_engine_at_a_time

    MULTIRANK_LOCK = str(tmp_path / "multirank.lock")
    monkeypatch.setattr(ranks, "MULTIRANK_LOCK", MULTIRANK_LOCK)

    with _one_multirank_engine_at_a_time(Deadline(1.0)):
        other = os.open(MULTIRANK_LOCK, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held
        finally:
            os.close(other)
    holder = os.open(MULTIRANK_LOCK, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with (pytest.raises(EngineStartError, match="another vLLM engine of tensor_parallel_size>1 ran on"),
              _one_multirank_engine_at_a_time(Deadline(0.2))):
            pass
    finally:
        os.close(holder)
    with _one_multirank_engine_at_a_time(Deadline(0.2)):  # free again
        pass


# --- import + inspect in one fork: the import check leaves the inspect verdict, the inspect check uses it -----------

FAKE_REGISTRY = {
    "vllm/plugins/__init__.py": "DEFAULT_PLUGINS_GROUP = 'vllm.general_plugins'\n\n\n"
                                "def load_general_plugins():\n    pass\n",
    "vllm/model_executor/models/__init__.py": "",
    "vllm/model_executor/models/registry.py": '''\
from dataclasses import dataclass


@dataclass
class _LazyRegisteredModel:
    module_name: str
    class_name: str


@dataclass
class _ModelInfo:
    architecture: str
    is_text_generation_model: bool

    @staticmethod
    def from_model_cls(model_cls):
        if model_cls.__name__.startswith("Bad"):
            raise ValueError(f"{model_cls.__name__} declares no rope_theta")
        return _ModelInfo(model_cls.__name__, True)


class _Registry:
    models = {name: _LazyRegisteredModel("vllm.model_executor.models.toy", name)
              for name in ("ToyForCausalLM", "BadForCausalLM")}


ModelRegistry = _Registry()
''',
    "vllm/model_executor/models/toy.py": "class ToyForCausalLM:\n    pass\n\n\nclass BadForCausalLM:\n    pass\n",
}


def _verdict(check: str, architecture: str, workdir: Path, inspect_mode: str = "fork") -> Any:
    from pytest_enginecheck.checks.runner import run_in_child

    ctx = CheckContext(check=check, spec="vllm", architecture=architecture, module="vllm.model_executor.models.toy",
                       class_name=architecture, workdir=str(workdir), inspect_mode=inspect_mode)
    result = run_in_child(ctx)
    return result.outcome, result.message, {k: v for k, v in result.detail.items() if k not in ("cached",)}


@pytest.fixture
def fake_registry(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    from pytest_enginecheck.targets.vllm.describe import plugins

    monkeypatch.setattr(plugins, "_loaded", None)
    return Path(fake_vllm(FAKE_REGISTRY))


def test_inspect_uses_the_verdict_the_import_check_built_and_imports_by_itself_without_one(
        fake_registry: Path, tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checks.inspect_check import inspection_path

    shared, alone = tmp_path / "session", tmp_path / "alone"
    assert _verdict("import", "ToyForCausalLM", shared)[0] == "passed"
    assert os.path.exists(inspection_path(CheckContext("inspect", "vllm", "ToyForCausalLM", "", "", str(shared))))
    by_itself = _verdict("inspect", "ToyForCausalLM", alone)  # run alone (-k, another worker or shard)
    assert by_itself[0] == "passed" and by_itself[2]["architecture"] == "ToyForCausalLM"
    # The model's module gone: only a check that does not import it again still passes.
    (fake_registry / "vllm/model_executor/models/toy.py").unlink()
    del sys.modules["vllm.model_executor.models.toy"]
    importlib.invalidate_caches()
    stored = _verdict("inspect", "ToyForCausalLM", shared)
    assert stored[:2] == by_itself[:2]
    assert stored[2] == {**by_itself[2], "built_by": "the import check's fork"}
    assert _verdict("inspect", "ToyForCausalLM", tmp_path / "fresh")[0] == "failed"


def test_an_inspection_failure_built_by_the_import_check_is_the_inspect_checks_own(fake_registry: Path,
                                                                                   tmp_path: Path) -> None:
    shared = tmp_path / "session"
    assert _verdict("import", "BadForCausalLM", shared)[0] == "passed"  # the import is clean; inspect is not
    stored = _verdict("inspect", "BadForCausalLM", shared)
    by_itself = _verdict("inspect", "BadForCausalLM", tmp_path / "alone")
    assert stored[0] == by_itself[0] == "failed"
    assert stored[1] == by_itself[1] == ("ValueError: BadForCausalLM declares no rope_theta (vLLM inspecting "
                                         "BadForCausalLM)")
    assert stored[2] == by_itself[2] and stored[2]["cause"] == "ValueError: BadForCausalLM declares no rope_theta"


def test_the_subprocess_inspection_is_never_built_by_the_import_check(fake_registry: Path, tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checks.inspect_check import inspection_path

    assert _verdict("import", "ToyForCausalLM", tmp_path, inspect_mode="subprocess")[0] == "passed"
    assert not os.path.exists(inspection_path(CheckContext("inspect", "vllm", "ToyForCausalLM", "", "",
                                                           str(tmp_path))))


@pytest.mark.parametrize("fate", ["crash", "hang"])
def test_a_crash_or_hang_while_building_the_stored_verdict_never_becomes_the_imports(
        fake_registry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fate: str) -> None:
    """The import check builds the inspect verdict in a fork of its own: vLLM's ModelInfo building that segfaults or
    hangs there stores nothing, the import passes, and the inspect check inspects by itself."""
    import signal

    from pytest_enginecheck.targets.vllm.checks import inspect_check

    def breaks(*args: Any) -> None:
        if fate == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(60)

    monkeypatch.setattr(inspect_check, "_store_inspection", breaks)
    monkeypatch.setattr(inspect_check, "STORE_TIMEOUT_S", 0.5)
    start = time.monotonic()
    assert _verdict("import", "ToyForCausalLM", tmp_path)[0] == "passed"
    assert time.monotonic() - start < 30  # the hang was cut at STORE_TIMEOUT_S, not waited for
    assert not os.path.exists(inspect_check.inspection_path(CheckContext("inspect", "vllm", "ToyForCausalLM", "", "",
                                                                  str(tmp_path))))


# --- ranklog: a rank's output, trimmed to what is about the outcome --------------------------------------------

RANK_OUTPUT = """\
(vllm-rank-0 pid=7) INFO 12-02 01:48:07 [model.py:733] Resolved architecture: EctpBadShardForCausalLM
(vllm-rank-0 pid=7) WARNING 12-02 01:48:07 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.
(vllm-rank-0 pid=7) WARNING 12-02 01:48:11 [base.py:380] Chat template warmup failed
(vllm-rank-0 pid=7) WARNING 12-02 01:48:11 [base.py:380] Traceback (most recent call last):
(vllm-rank-0 pid=7) WARNING 12-02 01:48:11 [base.py:380] ValueError: Tokenizer not available
(vllm-rank-0 pid=7) WARNING 12-02 01:48:11 [cpu_worker.py:140] CPU backend doesn't allow to use `torch.set_num_threads`
(vllm-rank-0 pid=7) ERROR 12-02 01:48:12 [core.py:9] EngineCore failed to start.
(vllm-rank-0 pid=7) ERROR 12-02 01:48:12 [core.py:9] RuntimeError: shape mismatch
Fatal Python error: Segmentation fault

"""


def test_a_rank_that_failed_keeps_its_warnings_and_errors_without_vllms_noise() -> None:
    from pytest_enginecheck.targets.vllm.engine.ranklog import trimmed_log

    lines = RANK_OUTPUT.splitlines()
    assert trimmed_log(RANK_OUTPUT, failed=True, label="vllm-rank-0").splitlines() == [
        lines[1], lines[6], lines[7], lines[8],
        "(enginecheck: 5 lines of vllm-rank-0's output, vLLM's log not about this outcome, left out; "
        "ENGINECHECK_VLLM_LOG=full keeps them)"]


def test_a_rank_that_answered_keeps_only_its_errors_and_full_keeps_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_enginecheck.targets.vllm.engine.ranklog import trimmed_log

    lines = RANK_OUTPUT.splitlines()
    assert trimmed_log(RANK_OUTPUT, failed=False).splitlines()[:3] == [lines[6], lines[7], lines[8]]
    assert "Chat template" not in trimmed_log(RANK_OUTPUT, failed=False)
    assert trimmed_log("", failed=False) == ""
    monkeypatch.setenv("ENGINECHECK_VLLM_LOG", "full")
    assert trimmed_log(RANK_OUTPUT, failed=False) == RANK_OUTPUT


# --- checkpoints: the shrink rules for strict configs (transformers' validators are the checker's limit) -----------

def test_a_hybrid_layout_keeps_one_layer_of_each_kind_and_attention_becomes_full() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_layout

    olmo_hybrid = ["linear_attention"] * 3 + ["full_attention"]
    assert tiny_layout(olmo_hybrid * 8, 2) == {"num_hidden_layers": 2,
                                               "layer_types": ["linear_attention", "full_attention"]}
    zamba2 = ["linear_attention"] * 5 + ["hybrid"] + ["sliding_attention"]
    assert tiny_layout(zamba2, 2) == {"num_hidden_layers": 3,
                                      "layer_types": ["linear_attention", "hybrid", "full_attention"]}
    assert tiny_layout(["sliding_attention"] * 40, 2)["layer_types"] == ["full_attention", "full_attention"]
    assert tiny_layout([], 2)["layer_types"] == ["full_attention", "full_attention"]


def test_mamba2_heads_follow_hidden_size_times_expand_and_its_groups_divide_them() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_sizes

    sizes = tiny_sizes({"hidden_size": 4096, "head_dim": 64, "num_heads": 128, "expand": 2, "n_groups": 8})
    assert sizes["hidden_size"] * 2 == sizes["num_heads"] * sizes["head_dim"]
    assert sizes["num_heads"] % sizes["n_groups"] == 0 and sizes["n_groups"] == 2
    assert "num_heads" not in tiny_sizes({"hidden_size": 4096, "head_dim": 64, "num_heads": 32})  # attention heads


def test_a_read_only_property_is_never_set_and_an_int_field_keeps_its_default_instead_of_none() -> None:
    import dataclasses

    from pytest_enginecheck.targets.vllm.checkpoints.shrink import _admits_none, _read_only

    @dataclasses.dataclass
    class StrictConfig:
        sliding_window: int = 512
        pad_token_id: int | None = 0

        @property
        def head_dim(self) -> int:
            return 32

    class LegacyConfig:
        sliding_window = 4096

    assert _read_only(StrictConfig, "head_dim") and not _read_only(StrictConfig, "sliding_window")
    assert not _admits_none(StrictConfig, "sliding_window") and _admits_none(StrictConfig, "pad_token_id")
    assert _admits_none(LegacyConfig, "sliding_window") and _admits_none(StrictConfig, "no_such_field")


class _MultimodalModel:
    """Stands for a vLLM model class transformers has no class for: multimodal, so no vLLM-side checkpoint."""

    supports_multimodal = True


def test_a_refused_tiny_checkpoint_is_refused_once_per_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason is kept beside the checkpoints: the session's other items skip with it, without trying again."""
    from pytest_enginecheck.targets.vllm.checkpoints import tiny

    with pytest.raises(tiny.NoTinyCheckpoint, match="is multimodal") as first:
        tiny.tiny_checkpoint("EctpNoClassMultimodalModel", str(tmp_path), _MultimodalModel)
    assert "has no class 'EctpNoClassMultimodalModel'" in str(first.value)

    def again(*args: Any) -> None:
        raise AssertionError("a refused checkpoint was tried again")

    monkeypatch.setattr(tiny, "make_tiny_checkpoint", again)
    with pytest.raises(tiny.NoTinyCheckpoint) as second:
        tiny.tiny_checkpoint("EctpNoClassMultimodalModel", str(tmp_path), _MultimodalModel)
    assert str(second.value) == str(first.value)
    assert not (tmp_path / tiny.CHECKPOINTS_DIR / "EctpNoClassMultimodalModel").exists()


# --- remote_config: the config fields a vLLM model's source reads, their values, the config module it writes ----

MODEL_SOURCE = '''\
class DecoderLayer:
    def __init__(self, config, prefix=""):
        self.hidden_size = config.hidden_size
        self.eps = getattr(config, "rms_norm_eps")
        self.window = getattr(config, "sliding_window", None)
        self.rotary = getattr(config, "partial_rotary_factor", 0.5)
        self.theta = getattr(config, "rope_theta", 10000.0)
        if hasattr(config, "kv_lora_rank"):
            self.rank = config.kv_lora_rank
        if getattr(config, "num_experts", 0):
            self.experts = config.num_experts
        self.text = config.get_text_config()


class Model:
    def __init__(self, vllm_config):
        hf_config = vllm_config.model_config.hf_config
        self.layers = hf_config.num_hidden_layers
        self.theta = hf_config.rope_theta
        self.quant = vllm_config.quant_config.weight_block_size

    def tie(self):
        return self.config.tie_word_embeddings
'''


def test_config_reads_tells_fields_that_need_a_value_from_those_read_with_a_default() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import config_reads

    reads = config_reads(MODEL_SOURCE)
    # rope_theta: read with a default once and plainly once, so it needs a value; a method (get_text_config) and
    # another config's field (quant_config.weight_block_size) are no fields
    assert reads.required == {"hidden_size", "rms_norm_eps", "num_hidden_layers", "rope_theta", "tie_word_embeddings"}
    assert reads.optional == {"partial_rotary_factor"}
    # the model has a path without them (hasattr; a default that says off: None, 0), read plainly or not
    assert reads.off == {"kv_lora_rank", "sliding_window", "num_experts"}


def test_field_values_give_sizes_and_llama_defaults_and_name_a_field_no_rule_knows() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import ConfigReads, config_reads, field_values
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_SIZES, NoTinyCheckpoint

    values = field_values("EctpModel", config_reads(MODEL_SOURCE))
    assert values["hidden_size"] == TINY_SIZES["hidden_size"] and values["num_hidden_layers"] == 2
    assert values["rms_norm_eps"] == 1e-6 and values["tie_word_embeddings"] is False
    assert values["vocab_size"] == TINY_SIZES["vocab_size"]  # vLLM's engine reads it of every config
    assert values["partial_rotary_factor"] == 1.0  # optional: a rule's value where one knows it
    # off: a rule's value where one knows it (no rule gives an MLA rank a model need not have), none in the second try
    assert values["num_experts"] == TINY_SIZES["num_experts"] and "kv_lora_rank" not in values
    without_off = field_values("EctpModel", config_reads(MODEL_SOURCE), leave_off=True)
    assert values.keys() - without_off.keys() == {"num_experts", "sliding_window"}
    with pytest.raises(NoTinyCheckpoint, match=r"EctpModel reads the config field ectp_window_pattern, which no rule"):
        field_values("EctpModel", ConfigReads(frozenset({"hidden_size", "ectp_window_pattern"}), frozenset()))


def test_the_remote_config_module_defines_the_model_type_and_its_defaults(tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        AUTO_MAP,
        CLASS_NAME,
        MODULE_FILE,
        RemoteConfig,
        engine_args,
    )

    remote = RemoteConfig("EctpForCausalLM", "ectp", {"hidden_size": 64, "rope_parameters": {"rope_theta": 1.0}})
    remote.write(tmp_path)
    module = _load_file(tmp_path / MODULE_FILE, "ectp_configuration_enginecheck")
    config = getattr(module, CLASS_NAME)(hidden_size=32)
    assert config.model_type == "ectp" and config.hidden_size == 32
    assert getattr(module, CLASS_NAME)().rope_parameters["rope_theta"] == 1.0
    assert remote.config().auto_map == AUTO_MAP and remote.config().architectures == ["EctpForCausalLM"]
    assert engine_args(tmp_path) == {}  # no config.json naming it yet
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": AUTO_MAP}))
    assert engine_args(tmp_path) == {"trust_remote_code": True}


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


def test_layout_fields_follow_the_tiny_layers_as_the_model_uses_them() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        SLIDING_WINDOW,
        ConfigReads,
        field_values,
        layout_values,
    )

    fields = frozenset({"layer_group_size", "bskcn_1", "bskcn_3", "interleaved_sliding_window"})
    values = layout_values(4, ["sliding_attention", "full_attention"] * 2, fields)
    # Bailing: one group of all the layers (its last full attention); Solar: save from layer 1 (layer 0 has no
    # residual), mix back in at the last; Plamo3: a window where a layer slides, None where it attends fully
    assert values == {"layer_group_size": 4, "bskcn_1": [1], "bskcn_3": [3],
                      "interleaved_sliding_window": [SLIDING_WINDOW, None, SLIDING_WINDOW, None]}
    reads = ConfigReads(frozenset({"hidden_size", "layer_types", "interleaved_sliding_window", "bskcn_4"}), frozenset())
    solar_plamo = field_values("EctpModel", reads)
    assert solar_plamo["layer_types"] == ["full_attention"] * 2 and solar_plamo["bskcn_4"] == [1]
    assert solar_plamo["interleaved_sliding_window"] == [None, None]


def test_a_record_field_reads_by_attribute_and_writes_as_json(tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        CLASS_NAME,
        DECI_BLOCK,
        MODULE_FILE,
        RemoteConfig,
    )

    remote = RemoteConfig("DeciLMForCausalLM", "nemotron-nas", {"hidden_size": 64, "block_configs": [DECI_BLOCK] * 2,
                                                                 "rope_parameters": {"rope_theta": 1.0}})
    remote.write(tmp_path)
    config = getattr(_load_file(tmp_path / MODULE_FILE, "ectp_deci_configuration"), CLASS_NAME)()
    block = config.block_configs[1]  # as DeciLM's BlockConfig dataclasses: block_config.attention.no_op
    assert block.attention.no_op is False and block.ffn.intermediate_size == 128
    assert not hasattr(block.ffn, "ffn_mult")  # vLLM's nemotron_nas.py takes intermediate_size where it is absent
    assert json.loads(config.to_json_string())["block_configs"][0] == DECI_BLOCK
    assert type(config.rope_parameters) is dict  # a field not a record stays a plain value


def test_dbrx_gets_the_hub_attention_rope_theta_that_transformers_moved() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.from_transformers import tiny_config

    config = tiny_config("DbrxForCausalLM")
    assert config.attn_config.rope_theta == config.rope_parameters["rope_theta"]
    assert json.loads(config.to_json_string())["attn_config"]["rope_theta"] == config.rope_parameters["rope_theta"]


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


# --- engine.vocab_size: the prompts' vocabulary, wherever the text decoder's config.json keeps it ----------------


@pytest.mark.parametrize("config, expected", [
    ({"vocab_size": 256, "text_config": {"vocab_size": 512}}, 256),  # a text decoder's own
    ({"text_config": {"vocab_size": 256}, "vision_config": {"hidden_size": 64}}, 256),  # Llava's
    ({"llm_config": {"vocab_size": 256}, "vit_config": {"vocab_size": 1024}}, 256),  # BagelConfig's: the smallest
    ({"config": {"text": {"vocab_size": 256}}}, 256),  # any depth (Moondream3's config.text)
])
def test_vocab_size_is_the_text_decoders_wherever_the_config_keeps_it(tmp_path: Path, config: dict[str, Any],
                                                                        expected: int) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.reading import vocab_size

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vocab_size(str(tmp_path)) == expected


# --- engine.uses_mla / checks.tp_comparison_skipped: MLA models run in bfloat16, their TP comparison is skipped ---

def test_mla_is_vllms_deepseek_mla_verdict_unless_bidirectional_disabled_or_the_transformers_backend() -> None:
    from types import SimpleNamespace

    from pytest_enginecheck.targets.vllm.engine.dtype import uses_mla

    mla = SimpleNamespace(model_type="deepseek_v2", kv_lora_rank=8)
    assert uses_mla(mla, True)
    assert not uses_mla(mla, False)  # vLLM's convertor said no (kv_lora_rank None, a model type not in its list)
    assert not uses_mla(SimpleNamespace(model_type="deepseek_v2", kv_lora_rank=8, is_causal=False), True)
    assert not uses_mla(mla, True, mla_disabled=True)  # VLLM_MLA_DISABLE
    # vLLM's Transformers backend decides by kv_lora_rank alone, whatever the convertor says
    assert uses_mla(mla, False, transformers_backend=True)
    assert not uses_mla(SimpleNamespace(model_type="llama"), True, transformers_backend=True)


def test_the_tp_comparison_is_skipped_only_off_float32_and_says_why() -> None:
    from pytest_enginecheck.targets.vllm.checks.load import tp_comparison_skipped

    assert tp_comparison_skipped("LlamaForCausalLM", 2, "float32") is None
    reason = tp_comparison_skipped("DeepseekV2ForCausalLM", 2, "bfloat16")
    assert reason is not None
    assert "built, loaded and generated at tensor_parallel_size=2 (bfloat16)" in reason
    assert "derived for float32" in reason and "MLA" in reason and "amx_mla.py" in reason


def test_an_engine_failure_names_the_dtype_vllm_ran_in() -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure

    failure = EngineFailure("load_model", 0, "ValueError: bad shard", "", "")
    assert "at tensor_parallel_size=2 (bfloat16): ValueError: bad shard" in failure.describe("X", 2, "bfloat16")
    assert "at tensor_parallel_size=2: ValueError" in failure.describe("X", 2)


def test_grouped_expert_routing_left_none_gets_one_group_and_a_set_one_is_kept() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_sizes

    assert tiny_sizes({"n_group": None, "topk_group": None}) == {"n_group": 1, "topk_group": 1}
    assert "n_group" not in tiny_sizes({"n_group": 8, "topk_group": 4})


def test_grouped_routing_over_tiny_experts_keeps_groups_that_hold_experts() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_GROUPS, TINY_SIZES, tiny_sizes

    sizes = tiny_sizes({"num_local_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4})
    assert sizes["n_group"] == TINY_GROUPS["n_group"] and sizes["topk_group"] == TINY_GROUPS["topk_group"]
    per_group = TINY_SIZES["num_local_experts"] // sizes["n_group"]
    assert TINY_SIZES["num_local_experts"] % sizes["n_group"] == 0
    assert sizes["topk_group"] * per_group >= sizes["num_experts_per_tok"]  # the chosen groups hold the top-k


def test_a_dense_layer_count_leaves_one_moe_layer_and_rotary_dim_keeps_its_share_of_the_head() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import tiny_sizes

    assert tiny_sizes({"num_hidden_layers": 24, "num_dense_layers": 2})["num_dense_layers"] == 1  # Lfm2-MoE
    assert "num_dense_layers" not in tiny_sizes({"num_hidden_layers": 24, "num_dense_layers": 1})  # kept: 1 of 2
    assert "first_k_dense_replace" not in tiny_sizes({"num_hidden_layers": 61, "first_k_dense_replace": 3})
    gptj = tiny_sizes({"hidden_size": 4096, "num_attention_heads": 16, "rotary_dim": 64})  # 64 of a 256 head
    assert gptj["rotary_dim"] == 8 and 0 < gptj["rotary_dim"] <= 64 // 2  # a quarter of the tiny head (32)
    full = tiny_sizes({"hidden_size": 4096, "num_attention_heads": 16, "head_dim": 128, "rotary_dim": 128})
    assert full["rotary_dim"] == full["head_dim"]


def test_hub_fields_give_the_hub_names_vllm_reads_from_what_transformers_wrote() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import hub_fields

    glm = {"model_type": "glm4_moe", "hidden_size": 64, "num_attention_heads": 2, "partial_rotary_factor": 0.5}
    assert hub_fields(glm) == {"head_dim": 32}
    hy = hub_fields({"model_type": "hy_v3", "moe_intermediate_size": 64, "mlp_layer_types": ["dense", "sparse"]})
    assert hy["expert_hidden_dim"] == 64 and hy["first_k_dense_replace"] == 1 and hy["qk_norm"] is True
    minimax = {"model_type": "minimax_m2", "head_dim": 32, "rope_parameters": {"partial_rotary_factor": 0.5}}
    assert hub_fields(minimax)["rotary_dim"] == 16
    assert hub_fields({"model_type": "lfm2", "hidden_size": 64}) == {"block_dim": 64, "conv_dim": 64}
    assert hub_fields({"model_type": "llama", "hidden_size": 64}) == {}


def test_what_transformers_writer_gets_wrong_is_repaired_by_name() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import written_name, zero_expert_tensors

    assert written_name("model.layers.1.hc_pre.hc_mlp_layer.hc_base", "hy_v4") == \
        "model.layers.1.hc_mlp_layer.hc_pre.hc_base"
    assert written_name("model.hc_pre.hc_head.hc_head_scale", "hy_v4") == "model.hc_head.hc_head_scale"
    assert written_name("model.hc_pre.hc_head.hc_head_scale", "llama") == "model.hc_pre.hc_head.hc_head_scale"
    names = ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.4.up_proj.weight",
             "model.layers.0.mlp.experts.12.gate_proj.weight", "model.layers.0.mlp.router.classifier.weight"]
    assert zero_expert_tensors(names, 4) == names[1:3]


def test_an_attribute_map_the_model_sets_makes_its_targets_reads() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import config_reads

    source = textwrap.dedent('''
        def build(vllm_config):
            vllm_config.model_config.hf_config.attribute_map = {"num_hidden_layers": "n_layer", "rms_norm_eps": 1}
            return vllm_config.model_config.hf_config
        ''')
    assert config_reads(source).required == frozenset({"n_layer"})


def test_a_stacking_mapper_names_the_shards_of_a_packed_layer_in_shard_order() -> None:
    from types import SimpleNamespace

    from pytest_enginecheck.targets.vllm.checkpoints.weight_layout import stacked_shards

    # TeleChat2Model's mapper (on the inner model, not the outer one): the hub's query/key/value, gate/up projections
    mapper = SimpleNamespace(orig_to_new_stacked={".value": (".qkv_proj", "v"), ".query": (".qkv_proj", "q"),
                                                  ".key": (".qkv_proj", "k"), ".up_proj": (".gate_up_proj", 1),
                                                  ".gate_proj": (".gate_up_proj", 0)})
    inner, outer = SimpleNamespace(hf_to_vllm_mapper=mapper), SimpleNamespace(hf_to_vllm_mapper=None)
    model = SimpleNamespace(modules=lambda: iter([outer, inner]))
    assert stacked_shards(model) == {"qkv_proj": ["query", "key", "value"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_a_norm_the_hub_has_in_every_layer_is_added_where_transformers_wrote_none(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import add_hub_norms

    moe_norm = "model.layers.1.post_mlp_layernorm.weight"  # transformers' AXK1 writes the MoE layer's only
    save_file({moe_norm: torch.full((64,), 2.0)}, str(tmp_path / "model.safetensors"))
    saved = {"model_type": "axk1", "hidden_size": 64, "num_hidden_layers": 2, "first_k_dense_replace": 1}
    assert add_hub_norms(tmp_path, saved) == ["model.layers.0.post_mlp_layernorm.weight"]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(tensors["model.layers.0.post_mlp_layernorm.weight"], torch.ones(64))
    assert torch.equal(tensors[moe_norm], torch.full((64,), 2.0))  # what transformers wrote is kept
    assert add_hub_norms(tmp_path, saved) == [] and add_hub_norms(tmp_path, {**saved, "model_type": "llama"}) == []


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


FOREIGN_BASE = '''\
class BaseConfig:
    def __init__(self):
        self.hidden_size = 64


class LlamaLike:
    config_class = BaseConfig

    def __init__(self, config):
        self.width = config.hidden_size
        self.window = config.sliding_window  # the base's own module: read where its config has it
'''
FOREIGN_CHILD = '''\
from enginecheck_foreign_base import LlamaLike


class TeleLike(LlamaLike):
    def __init__(self, config):
        super().__init__(config)
        self.heads = config.n_head
'''


def test_a_base_class_whose_config_lacks_what_the_subclass_reads_is_foreign(tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.from_transformers import foreign_base

    (tmp_path / "enginecheck_foreign_base.py").write_text(FOREIGN_BASE)
    (tmp_path / "enginecheck_foreign_child.py").write_text(FOREIGN_CHILD)
    (tmp_path / "enginecheck_foreign_plain.py").write_text(
        "from enginecheck_foreign_base import LlamaLike\n\n\nclass Plain(LlamaLike):\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        child = importlib.import_module("enginecheck_foreign_child")
        base = importlib.import_module("enginecheck_foreign_base")
        plain = importlib.import_module("enginecheck_foreign_plain")
        reason = foreign_base("TeleLike", child.TeleLike, base.LlamaLike)
        assert "reads the config field n_head, which BaseConfig of its base class LlamaLike has not" in reason
        assert "sliding_window" not in reason  # read by the base's own module
        assert foreign_base("Plain", plain.Plain, base.LlamaLike) == ""  # reads nothing beyond the base's
        assert foreign_base("LlamaLike", base.LlamaLike, base.LlamaLike) == ""  # transformers' own class
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("enginecheck_foreign_base", "enginecheck_foreign_child", "enginecheck_foreign_plain"):
            sys.modules.pop(name, None)


# --- the tiny configs of models vLLM builds with MLA attention, and of Isaac's M-RoPE head ---

def test_mla_sizes_read_with_a_default_are_written_and_an_mla_test_or_off_default_is_not() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        MLA_FIELDS,
        ConfigReads,
        _mla_sizes,
        field_values,
    )

    # Bailing V2.5/V3: getattr(config, "kv_lora_rank", 512) and the other MLA sizes with defaults; q_lora_rank None
    reads = ConfigReads(frozenset({"hidden_size"}), frozenset({"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                                "v_head_dim"}), frozenset({"q_lora_rank"}))
    values = field_values("EctpModel", reads)
    mla = _mla_sizes()
    assert {f: values[f] for f in MLA_FIELDS if f in values} == {f: mla[f] for f in MLA_FIELDS if f != "q_lora_rank"}
    assert "q_lora_rank" not in values  # an "off" default: the path without the query's LoRA
    # openPangu: MLA sizes only tested with hasattr, a model that has a path without them: none written
    pangu = field_values("EctpModel", ConfigReads(frozenset({"hidden_size"}), frozenset(), frozenset(MLA_FIELDS)))
    assert not set(MLA_FIELDS) & pangu.keys()


def test_lightning_attention_gets_a_head_its_blocks_divide_and_bailing_v3_is_bailing_hybrid() -> None:
    from types import SimpleNamespace

    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        LIGHTNING_HEAD_DIM,
        ConfigReads,
        field_values,
        remote_model_type,
    )
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_SIZES

    reads = ConfigReads(frozenset({"hidden_size", "head_dim"}), frozenset())
    assert field_values("BailingMoeV2_5ForCausalLM", reads)["head_dim"] == LIGHTNING_HEAD_DIM
    assert LIGHTNING_HEAD_DIM % 64 == 0  # lightning_attn.py's blocks of a head under 128
    assert field_values("BailingMoeV3ForCausalLM", reads)["head_dim"] == TINY_SIZES["head_dim"]  # KDA: no blocks
    module = SimpleNamespace(__module__="vllm.model_executor.models.bailing_moe_v3")
    for architecture in ("BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM"):
        # a model type vLLM's convertor counts among its MLA types (with kv_lora_rank set)
        assert remote_model_type(architecture, module, {}) == "bailing_hybrid"  # type: ignore[arg-type]


def test_sarvams_head_dim_is_its_mla_head_as_on_the_hub() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import hub_fields

    sarvam = {"model_type": "sarvam_mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "hidden_size": 64}
    assert hub_fields(sarvam) == {"head_dim": 576}  # one of the head sizes vLLM's MLA metadata accepts


def test_isaacs_top_level_head_dim_is_its_text_decoders() -> None:
    from types import SimpleNamespace

    from pytest_enginecheck.targets.vllm.checkpoints.multimodal import _hub_layout

    text = SimpleNamespace(head_dim=32)

    class Isaac:
        head_dim = 128  # IsaacConfig's copy of the full-size decoder's fields at its top level

        def to_json_string(self, use_diff: bool = True) -> str:
            return json.dumps({"model_type": "isaac", "head_dim": self.head_dim, "text_config": {"head_dim": 32}})

        def get_text_config(self) -> SimpleNamespace:
            return text

    saved = _hub_layout("IsaacForConditionalGeneration", "isaac", Isaac())
    # Isaac's M-RoPE sections [head_dim // 4, head_dim // 8, head_dim // 8] add up to half the text decoder's head
    assert saved["head_dim"] == 32
    assert sum([saved["head_dim"] // 4, saved["head_dim"] // 8, saved["head_dim"] // 8]) == text.head_dim // 2


def test_a_model_refers_to_mla_through_its_own_module_or_a_base_class_module() -> None:
    import types

    from pytest_enginecheck.targets.vllm.engine.dtype import refers_to_mla

    base_module = types.ModuleType("enginecheck_mla_base")
    base_module.MultiHeadLatentAttentionWrapper = object  # type: ignore[attr-defined]  # imported from vLLM's mla.py
    child_module = types.ModuleType("enginecheck_mla_child")
    base = type("SarvamLike", (), {"__module__": base_module.__name__})
    child = type("Child", (base,), {"__module__": child_module.__name__})
    plain = type("Plain", (), {"__module__": child_module.__name__})
    sys.modules.update({base_module.__name__: base_module, child_module.__name__: child_module})
    try:
        assert refers_to_mla(base) and refers_to_mla(child)  # the base class's module builds the MLA layer
        assert not refers_to_mla(plain)
    finally:
        for name in (base_module.__name__, child_module.__name__):
            sys.modules.pop(name, None)
