"""The reference oracle's margin and cost (pytest_enginecheck/targets/engine_ref/reference.py), side by side in one
run: for each architecture of the bundled zoo and of zoo.reference_registry (the oracle's planted bugs and clean
twins), the largest |log p(engine) - log p(reference)| over every position and token of the load check's prompts
and the tokens the engine generates for them, against LOGPROB_TOLERANCE, and the seconds to load the reference.

    python benchmarks/reference_oracle.py

A clean model's largest difference is the float32 rounding of two implementations; the tolerance must sit well
above every clean one and well below every planted bug's.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests" / "plugin_zoo"))


def main() -> None:
    from zoo.reference_registry import REGISTRY

    from engine_ref import ModelRegistry
    from engine_ref.entrypoints.llm import LLM
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint
    from pytest_enginecheck import reference as lookup
    from pytest_enginecheck.guard import CudaGuard
    from pytest_enginecheck.targets.engine_ref import reference
    from pytest_enginecheck.targets.engine_ref.kv_consistency import load_tp1
    from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry
    from pytest_enginecheck.targets.engine_ref.tiny_engine import BLOCK_SIZE, MAX_TOKENS, checkpoint_prompts

    print(f"{'architecture':40} {'largest difference':>18} {'x tolerance':>11} {'load s':>7}  reference")
    with tempfile.TemporaryDirectory() as tmp:
        for spec, registry in (("engine_ref", ModelRegistry), ("zoo.reference_registry:REGISTRY", REGISTRY)):
            engine_ref_registry(spec)
            for arch in registry.models:
                ckpt = make_checkpoint(arch, Path(tmp) / arch, registry=registry)
                found = lookup.find_reference(arch, registry.resolve_model_cls(arch))
                if found is None:
                    print(f"{arch:40} {'-':>18} {'-':>11} {'-':>7}  none (self-consistency only)")
                    continue
                with LLM(str(ckpt), device_memory="512MiB", max_model_len=128, block_size=BLOCK_SIZE) as llm:
                    vocab = llm.engine.config.model_config.hf_text_config.vocab_size
                    outputs = llm.generate(checkpoint_prompts(ckpt), max_tokens=MAX_TOKENS, ignore_eos=True)
                start = time.perf_counter()
                ref = lookup.load_reference(found, ckpt)
                seconds = time.perf_counter() - start
                with torch.inference_mode():
                    model = load_tp1(spec, ckpt, 0, CudaGuard())
                    sequences = [p + o for p, o in zip(checkpoint_prompts(ckpt), outputs, strict=True)]
                    largest = max(float((reference.engine_logprobs(model, s)[:, :vocab]
                                         - reference.reference_logprobs(ref, s)[:, :vocab]).abs().max())
                                  for s in sequences)
                print(f"{arch:40} {largest:18.3g} {largest / reference.LOGPROB_TOLERANCE:11.3g} {seconds:7.2f}  "
                      f"{found.name}")


if __name__ == "__main__":
    main()
