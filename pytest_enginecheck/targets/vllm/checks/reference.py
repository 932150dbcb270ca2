"""The vLLM target's reference oracle, shared by load[tp=1] and lora[tp=1]: vLLM's log-probabilities on the tokens it
generated against a reference implementation's (``pytest_enginecheck.reference``), teacher-forced on the same tokens
on the same tiny checkpoint, float32.

load[tp=1] holds the model to the reference its class declares (``enginecheck_reference``) or to transformers' class
of the architecture's own name, never to a base class's (a subclass that computes something else on purpose would
fail); where there is none, or vLLM runs the model in another dtype, or the reference cannot run the checkpoint,
the result's ``oracle`` is ``none`` with the reason (the summary counts it).
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.targets.vllm.engine.drive import checkpoint_prompts

# How far vLLM's log-probabilities (float32 CPU) may be from transformers' (+ PEFT's) on the same tiny checkpoint and
# tokens. Different kernels sum in a different order (vLLM's CPU attention, fused RMSNorm, SiLU-and-mul, its LoRA
# shrink/expand einsums against PEFT's two matmuls): measured at TP=1 on the tiny Llama and Qwen2, with the adapter
# and without it, at most 9.5e-7 (1-2 float32 ulps of a log-probability near -5.5). The tolerance sits 100x above
# that, and 1000x below what the planted same-at-every-TP bug gives (layer 1's gate_proj and up_proj adapters
# swapped: the first generated token is one transformers + PEFT finds 0.11 less likely than its greedy choice).
# tests/vllm/test_vllm_lora.py holds both ends. (TP=N against TP=1 uses load's LOGPROB_TOLERANCE: measured 1.4e-6.)
ORACLE_TOLERANCE = 1e-4


def oracle_difference(model: Any, ckpt: str, tokens: list[list[int]], logprobs: list[list[dict[str, float]]]
                      ) -> tuple[float, int, int, str]:
    """The reference ``model``'s log-probabilities (transformers', or with PEFT's adapter) at vLLM's generated
    positions, teacher-forced on vLLM's tokens, against vLLM's ``logprobs`` of those positions: (largest |difference|
    over the tokens vLLM reports, prompt, generated token, what differs). A generated token that is not the
    reference's greedy choice (its log-probability more than ORACLE_TOLERANCE below the reference's largest) is
    reported as such, with its shortfall as the difference."""
    import torch

    worst = (0.0, 0, 0, "log-probabilities")
    for i, (prompt, generated, positions) in enumerate(zip(checkpoint_prompts(ckpt), tokens, logprobs, strict=True)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated])).logits[0]
        reference = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:]  # row k predicts generated token k
        for k, (token, reported) in enumerate(zip(generated, positions, strict=True)):
            shortfall = float(reference[k].max() - reference[k, token])
            if shortfall > ORACLE_TOLERANCE:
                best = int(reference[k].argmax())
                return shortfall, i, k, (f"greedy token {token} (the reference's greedy choice is {best}, "
                                         f"{shortfall:.3g} more likely in log-probability)")
            for other, value in reported.items():
                if abs(value - float(reference[k, int(other)])) > worst[0]:
                    worst = (abs(value - float(reference[k, int(other)])), i, k, "log-probabilities")
    return worst

