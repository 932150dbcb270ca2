"""The import verdict of a missing dependency (checks/failures.py): torch's companion packages under torch's CPU
build say why they are missing, any other package keeps the plain verdict."""

from __future__ import annotations

import importlib.metadata

import pytest

from pytest_enginecheck.checks import CheckContext
from pytest_enginecheck.checks.failures import import_failure

CTX = CheckContext(check="import", spec="vllm", architecture="Qwen2VLForConditionalGeneration",
                   module="vllm.model_executor.models.qwen2_vl", class_name="Qwen2VLForConditionalGeneration",
                   workdir="")


def _missing(name: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_torchvision_missing_under_cpu_torch_says_why() -> None:
    torch_version = importlib.metadata.version("torch")
    if not torch_version.endswith("+cpu"):
        pytest.skip(f"torch {torch_version} is not the CPU build")
    failure = import_failure(CTX, _missing("torchvision"))
    assert failure.message == (
        f"Importing vllm.model_executor.models.qwen2_vl failed: it imports 'torchvision', which is not installed. "
        f"torch here is the CPU build ({torch_version}), and PyPI's torchvision wheels are built for PyPI's CUDA "
        f"torch: against this one they fail to load (\"operator torchvision::nms does not exist\"), so torchvision "
        f"must be the CPU build of the matching release, from https://download.pytorch.org/whl/cpu. Install that "
        f"build, or import it lazily inside the code that needs it.")
    assert (failure.detail["kind"], failure.detail["dependency"]) == ("missing_dependency", "torchvision")
    assert "torchaudio must be the CPU build" in import_failure(CTX, _missing("torchaudio")).message


def test_other_missing_dependency_keeps_the_plain_verdict() -> None:
    failure = import_failure(CTX, _missing("flash_attn"))
    assert failure.message == ("Importing vllm.model_executor.models.qwen2_vl failed: it imports 'flash_attn', "
                               "which is not installed. Install it, or import it lazily inside the code that needs it.")
    assert "why" not in failure.detail
