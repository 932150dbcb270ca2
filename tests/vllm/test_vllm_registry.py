"""vLLM's registry with the test plugins loaded: listing (string- and class-registered), the import
check under the guard, and in-fork inspection equal to vLLM's own subprocess inspection."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.settings import Settings


def _ctx(workdir: str, architecture: str, check: str = "import", strict: bool = False,
         inspect_mode: str = "fork") -> CheckContext:
    return CheckContext(check=check, spec="vllm", architecture=architecture, module="", class_name="",
                        workdir=workdir, options=Settings(strict=strict, target_options=(("inspect", inspect_mode),)))


def _entries() -> dict[str, Any]:
    from pytest_enginecheck.targets.vllm.describe.registry import list_architectures

    return {e.architecture: e for e in list_architectures()}


def test_lists_in_tree_plugin_and_class_registered_architectures(in_child: Any) -> None:
    entries = in_child(_entries)
    assert entries["LlamaForCausalLM"].module == "vllm.model_executor.models.llama"
    assert (entries["EctpCleanForCausalLM"].module, entries["EctpCleanForCausalLM"].registered_as) == (
        "ectp.models.clean", "lazy")
    classed = entries["EctpClassForCausalLM"]
    assert (classed.module, classed.class_name, classed.registered_as) == (
        "ectp.models.class_registered", "EctpClassForCausalLM", "class")
    assert "EctpCudaForCausalLM" in entries and "EctpBadShardForCausalLM" in entries


def _import(workdir: str, architecture: str) -> str:
    from pytest_enginecheck.targets.vllm.checks.import_check import run_import

    try:
        return str(run_import(_ctx(workdir, architecture)))
    except CheckFailure as e:
        return e.message


@pytest.mark.parametrize("architecture", ["EctpCleanForCausalLM", "EctpClassForCausalLM", "LlamaForCausalLM"])
def test_clean_models_import(in_child: Any, tmp_path: Any, architecture: str) -> None:
    assert "registered_as" in in_child(_import, str(tmp_path), architecture)


def test_cuda_behind_a_two_module_chain_is_blamed_on_its_line(in_child: Any, tmp_path: Any) -> None:
    message = in_child(_import, str(tmp_path), "EctpCudaForCausalLM")
    assert message.startswith("Importing ectp.models.cuda_model touched CUDA")
    assert "ectp/models/cuda_helper.py:3" in message and "torch.cuda.get_device_name(0)" in message
    assert "Import chain: ectp.models.cuda_model -> ectp.models.cuda_helper." in message


def _inspect_both(workdir: str, architectures: list[str]) -> dict[str, tuple[dict, dict]]:
    import os

    from pytest_enginecheck.targets.vllm.checks.inspect_check import run_inspect
    from pytest_enginecheck.targets.vllm.env import redirect_caches

    os.environ["VLLM_PLUGINS"] = "clean,class_registered"  # the raising plugin breaks vLLM's subprocess (below)
    redirect_caches(workdir)  # a private, empty modelinfos cache: the subprocess really runs
    return {a: (run_inspect(_ctx(workdir, a, "inspect")),
                run_inspect(_ctx(workdir, a, "inspect", inspect_mode="subprocess"))) for a in architectures}


def test_fork_inspection_equals_vllms_subprocess(in_child: Any, tmp_path: Any) -> None:
    sample = ["LlamaForCausalLM", "MixtralForCausalLM", "EctpCleanForCausalLM"]
    results = in_child(_inspect_both, str(tmp_path), sample, timeout=600)
    for architecture, (fork, subprocess) in results.items():
        # the ModelInfo, not what each mode says of vLLM's modelinfos cache (the subprocess reads it, the fork not)
        assert {k: v for k, v in fork.items() if k != "cache"} == {k: v for k, v in subprocess.items()
                                                                   if k != "cache"}, architecture
        assert isinstance(subprocess["cache"], dict) and isinstance(fork["cache"], str)
        assert fork["is_text_generation_model"] is True
    assert results["MixtralForCausalLM"][0]["architecture"] == "MixtralForCausalLM"


def _inspect_subprocess(workdir: str, architecture: str) -> str:
    from pytest_enginecheck.targets.vllm.checks.inspect_check import run_inspect

    try:
        return str(run_inspect(_ctx(workdir, architecture, "inspect", inspect_mode="subprocess")))
    except CheckFailure as e:
        return e.message


def test_a_raising_plugin_breaks_vllms_own_inspection_of_in_tree_models(in_child: Any, tmp_path: Any) -> None:
    # vLLM's inspection subprocess runs every plugin first, unguarded: one broken plugin fails them all.
    message = in_child(_inspect_subprocess, str(tmp_path), "Qwen2ForCausalLM")
    first_line = message.splitlines()[0]
    assert first_line == ("RuntimeError: ectp: the raising plugin cannot find its configuration (vLLM's inspection "
                          "subprocess, inspecting Qwen2ForCausalLM)")
    assert 'ectp/entry.py", line 22, in register_raising' in message
