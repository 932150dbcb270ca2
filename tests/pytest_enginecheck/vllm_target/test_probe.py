"""The probe's degradation on fake ``vllm`` trees (the ``fake_vllm`` fixture): a vLLM that lacks what the adapter
needs ends in one clear VllmUnavailable, which the checks turn into a skip; and importing the target's modules
imports no engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckSkip
from tests.pytest_enginecheck.vllm_target.helpers import _ckpt

# --- probe: a vLLM that lacks what the adapter needs ends in one clear VllmUnavailable ------------------------

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
    root = Path(__file__).parents[3] / "pytest_enginecheck" / "targets" / "vllm"
    modules = sorted(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                     for p in root.rglob("*.py") if p.name != "__init__.py" or p.parent != root)
    modules.remove("describe.warm")
    assert {"probe", "describe.registry", "checkpoints.tiny", "engine.run", "checks.load"} <= set(modules)
    code = ("import sys\n" + "".join(f"import pytest_enginecheck.targets.vllm.{m}\n" for m in modules)
            + "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr
