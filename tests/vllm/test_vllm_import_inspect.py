"""import + inspect in one fork on vLLM's real registry: the inspect verdict the import check builds after a clean
import is the one the inspect check builds by itself; a failed import leaves none."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure


def _ctx(workdir: str, architecture: str, check: str) -> CheckContext:
    return CheckContext(check=check, spec="vllm", architecture=architecture, module="", class_name="",
                        workdir=workdir)


def _verdicts(workdir: str, architectures: list[str]) -> dict[str, tuple[Any, Any, bool]]:
    """Per architecture: (inspect after the import check in ``workdir``, inspect alone, whether a verdict was kept)."""
    from pytest_enginecheck.targets.vllm.checks.import_check import run_import
    from pytest_enginecheck.targets.vllm.checks.inspect_check import inspection_path, run_inspect

    def inspect(ctx: CheckContext) -> Any:
        try:
            return run_inspect(ctx)
        except CheckFailure as e:
            return e.message

    os.environ["VLLM_PLUGINS"] = "clean,class_registered,cuda_chain"  # in the check child only
    verdicts = {}
    for architecture in architectures:
        shared = _ctx(os.path.join(workdir, "session"), architecture, "import")
        with contextlib.suppress(CheckFailure):
            run_import(shared)
        kept = os.path.exists(inspection_path(shared))
        verdicts[architecture] = (inspect(_ctx(shared.workdir, architecture, "inspect")),
                                  inspect(_ctx(os.path.join(workdir, "alone"), architecture, "inspect")), kept)
    return verdicts


def test_the_import_checks_inspection_is_the_inspect_checks_own(in_child: Any, tmp_path: Any) -> None:
    results = in_child(_verdicts, str(tmp_path), ["LlamaForCausalLM", "MixtralForCausalLM", "EctpClassForCausalLM",
                                                  "EctpCudaForCausalLM"], timeout=600)
    for architecture in ("LlamaForCausalLM", "MixtralForCausalLM", "EctpClassForCausalLM"):
        stored, alone, kept = results[architecture]
        assert kept and stored.pop("built_by") == "the import check's fork", architecture
        assert stored == alone and stored["architecture"] == architecture
    stored, alone, kept = results["EctpCudaForCausalLM"]
    assert not kept and stored == alone and stored.startswith("Importing ectp.models.cuda_model touched CUDA")
