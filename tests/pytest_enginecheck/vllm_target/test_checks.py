"""The vLLM target's checks without vLLM: TP verification, the log-probability comparison and when it is skipped,
the import and inspect checks in one fork over a fake registry, and the TP diagnosis naming a module's weight
loaders."""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckSkip
from pytest_enginecheck.settings import Settings
from tests.pytest_enginecheck.vllm_target.helpers import _ckpt

# --- checks: TP verification and the log-probability comparison -----------------------------------------------

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


def test_the_tp_comparison_is_skipped_only_off_float32_and_says_why() -> None:
    from pytest_enginecheck.targets.vllm.checks.load import tp_comparison_skipped

    assert tp_comparison_skipped("LlamaForCausalLM", 2, "float32") is None
    reason = tp_comparison_skipped("DeepseekV2ForCausalLM", 2, "bfloat16")
    assert reason is not None
    assert "built, loaded and generated at tensor_parallel_size=2 (bfloat16)" in reason
    assert "derived for float32" in reason and "MLA" in reason and "amx_mla.py" in reason


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
                       class_name=architecture, workdir=str(workdir),
                       options=Settings(target_options=(("inspect", inspect_mode),)))
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


# --- checks.diagnosis: the weight loaders of the first differing module, named in the workers --------------------

def test_a_weight_loader_is_named_with_its_function_file_and_line(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    import torch

    from pytest_enginecheck.tp_compare import loaded_by, loader_name, weight_loaders

    monkeypatch.chdir(Path(__file__).parent)  # tmp_path is outside the working directory: its files named in full
    source = tmp_path / "ectp_loaders.py"
    source.write_text("import functools\n\n\nclass Layer:\n    def weight_loader(self, param, loaded):\n"
                      "        pass\n\n\ndef load_scaled(param, loaded, scale):\n    pass\n\n\nclass Loader:\n"
                      "    def __call__(self, param, loaded):\n        pass\n\n\n"
                      "@functools.wraps(load_scaled)\ndef synced(*args):\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module("ectp_loaders")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("ectp_loaders", None)
    layer = mod.Layer()
    assert loader_name(layer.weight_loader) == f"Layer.weight_loader ({source}:5)"  # a bound method: its function
    assert loader_name(functools.partial(mod.load_scaled, scale=2)) == f"load_scaled ({source}:9)"  # what it wraps
    assert loader_name(mod.Loader()) == f"Loader.__call__ ({source}:14)"
    assert loader_name(mod.synced) == f"load_scaled ({source}:9)"  # functools.wraps: the wrapped function
    assert loader_name(len) == "len" and loader_name(None) is None  # no Python source; no loader

    module = torch.nn.Linear(2, 2)
    module.weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
    module.bias.weight_loader = functools.partial(mod.load_scaled, scale=2)  # type: ignore[attr-defined]
    assert weight_loaders(module) == [f"Layer.weight_loader ({source}:5)", f"load_scaled ({source}:9)"]
    module.bias.weight_loader = mod.Layer().weight_loader  # type: ignore[attr-defined]  # the same function
    assert weight_loaders(module) == [f"Layer.weight_loader ({source}:5)"]
    assert weight_loaders(torch.nn.Linear(2, 2)) == []
    assert loaded_by(["A.w (a.py:1)", "B.w (b.py:2)", "C.w (c.py:3)"]) == (
        "its parameters were loaded by A.w (a.py:1), B.w (b.py:2) and C.w (c.py:3)")
    assert loaded_by([]) == ""


FAKE_LINEAR = {
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/linear.py": (
        "import torch\n\nWEIGHT_LOADER_V2_SUPPORTED = ['UnquantizedLinearMethod']\n\n\n"
        "class UnquantizedLinearMethod:\n    pass\n\n\nclass OtherMethod:\n    pass\n\n\n"
        "class ColumnParallelLinear(torch.nn.Module):\n    def __init__(self, method):\n        super().__init__()\n"
        "        self.quant_method = method\n"
        "        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # packed: no loader\n\n"
        "    def weight_loader(self, param, loaded):\n        pass\n\n"
        "    def weight_loader_v2(self, param, loaded):\n        pass\n\n\n"
        "class QKVParallelLinear(ColumnParallelLinear):\n    pass\n\n\n"
        "class RowParallelLinear(ColumnParallelLinear):\n    pass\n"),
    "vllm/model_executor/layers/vocab_parallel_embedding.py": "class VocabParallelEmbedding:\n    pass\n",
}


def test_a_weight_vllm_packed_after_loading_is_named_by_the_loader_its_layer_gave_it(
        fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU backend replaces a linear layer's weight by a packed one without its loader: the diagnosis names
    the loader vLLM's layer gives its weight (weight_loader_v2 for the quant methods vLLM lists), in the worker."""
    import torch

    from pytest_enginecheck.targets.vllm.checks.diagnosis import RankCapture, compare, module_loaders

    monkeypatch.chdir(Path(__file__).parent)  # the fake vLLM is outside the working directory: named in full
    root = fake_vllm(FAKE_LINEAR)
    linear = importlib.import_module("vllm.model_executor.layers.linear")
    path = root / "vllm" / "model_executor" / "layers" / "linear.py"
    lines = path.read_text().splitlines()
    v1, v2 = (lines.index(f"    def {name}(self, param, loaded):") + 1 for name in ("weight_loader",
                                                                                    "weight_loader_v2"))
    row = linear.RowParallelLinear(linear.UnquantizedLinearMethod())
    assert module_loaders(row) == [f"ColumnParallelLinear.weight_loader_v2 ({path}:{v2})"]
    assert module_loaders(linear.RowParallelLinear(linear.OtherMethod())) == [
        f"ColumnParallelLinear.weight_loader ({path}:{v1})"]
    row.weight.weight_loader = row.weight_loader  # not packed: the parameter's own loader
    assert module_loaders(row) == [f"ColumnParallelLinear.weight_loader ({path}:{v1})"]
    assert module_loaders(torch.nn.LayerNorm(2)) == []  # not a parallel linear layer, no loader

    x, full = torch.randn(3, 8), torch.randn(3, 4)
    one, ranks = RankCapture(rank=0), [RankCapture(rank=r) for r in range(2)]
    name = "model.layers.1.mlp.down_proj"
    row_layout = {"style": "whole", "how": "all-reduced", "local": {"style": "partial"}}
    for capture, inp, out, local in zip([one, *ranks], [x, x[:, :4], x[:, 4:]], [full, full + 1, full + 1],
                                        [None, full / 2 + 1, full / 2], strict=True):
        capture.order.append(name)
        capture.outputs[name], capture.inputs[name], capture.classes[name] = out, inp, "RowParallelLinear"
        capture.layouts[name] = row_layout if capture is not one else {"style": "whole"}
        capture.loaders[name] = [f"ColumnParallelLinear.weight_loader_v2 ({path}:{v2})"]
        if local is not None:
            capture.local[name] = local
    assert compare(one, ranks, 2).endswith(
        f"{name}'s weight shards are wrong (a sharding bug in its weight_loader; a row-parallel weight needs its "
        f"rank's input columns): its parameters were loaded by ColumnParallelLinear.weight_loader_v2 ({path}:{v2}).")
