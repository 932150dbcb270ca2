"""The vLLM quant check's expert oracle (targets/vllm/quant_experts.py) without vLLM: its bound holds for a kernel
that computes what the int8 W8A8 scheme prescribes (simulated here in float32 and bfloat16, as vLLM's CPU kernel
does), and a down projection scale 5 % off in one expert falls outside it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_enginecheck.targets.vllm.checks.quant_experts import SHARDS, dequantized_interval, reference, routing

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 64, 4, 2


def _experts(seed: int) -> dict[str, torch.Tensor]:
    """Dequantized expert weights, each an int8 value times a power-of-two scale per output channel."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(EXPERTS):
        for shard, shape in zip(SHARDS, [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)], strict=True):
            q = torch.randint(-127, 128, shape, generator=g).float()
            tensors[f"{e}:{shard}"] = q * 2.0 ** torch.randint(-14, -10, (shape[0], 1), generator=g).float()
    return tensors


def _tokens(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randint(-127, 128, (EXPERTS, HIDDEN), generator=g)
    q[:, 0] = 127  # every row's largest |value| is 127 units: its per-token int8 quantization is exact
    return q.float() * 2.0**-7


def _kernel(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, tensors: dict[str, torch.Tensor],
            shard: tuple[int, int]) -> torch.Tensor:
    """The scheme as vLLM's CPU kernel runs it, on the rank's shard: gate/up in float32, the intermediate rounded
    into bfloat16 and quantized per token to int8, the down projection's exact sum scaled in float32, each expert's
    weighted output rounded into bfloat16, their sum rounded again."""
    rank, tp = shard
    out = torch.zeros(x.shape, dtype=torch.bfloat16)
    for t in range(x.shape[0]):
        parts = []
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up, down = (tensors[f"{e}:{s}"] for s in SHARDS)
            rows = slice(rank * INTERMEDIATE // tp, (rank + 1) * INTERMEDIATE // tp)
            a = (torch.nn.functional.silu(gate[rows] @ x[t]) * (up[rows] @ x[t])).to(torch.bfloat16).float()
            scale = a.abs().max() / 127
            q = torch.round(a / scale)
            parts.append(((down[:, rows].double() @ q.double()).float() * scale * weights[t, j]).to(torch.bfloat16))
        out[t] = torch.stack([p.float() for p in parts]).sum(0).to(torch.bfloat16)
    return out.double()


def _names() -> dict[str, str]:
    return {f"{e}:{s}": f"{e}:{s}" for e in range(EXPERTS) for s in SHARDS}


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), tp=st.sampled_from([1, 2]))
def test_a_kernel_that_follows_the_scheme_stays_within_the_bound(seed: int, tp: int) -> None:
    tensors, x = _experts(seed), _tokens(seed)
    ids, weights = routing(EXPERTS, TOP_K)
    for rank in range(tp):
        y = _kernel(x, ids, weights, tensors, (rank, tp))
        center, bound = reference(x.double(), ids, weights.double(), _names(), (rank, tp), tensors, torch.bfloat16)
        assert bool(((y - center).abs() <= bound).all()), float(((y - center).abs() / bound).max())


@pytest.mark.parametrize("tp", [1, 2])
def test_a_down_scale_5_percent_off_in_one_expert_falls_outside_the_bound(tp: int) -> None:
    tensors, x = _experts(7), _tokens(7)
    ids, weights = routing(EXPERTS, TOP_K)
    wrong = {**tensors, "2:w2": tensors["2:w2"] * 1.05}
    for rank in range(tp):
        y = _kernel(x, ids, weights, wrong, (rank, tp))
        center, bound = reference(x.double(), ids, weights.double(), _names(), (rank, tp), tensors, torch.bfloat16)
        outside = ((y - center).abs() > bound).any(dim=1)
        # the tokens expert 2 serves (token 2 first, token 1 second) leave the bound; the others stay within it
        assert outside.tolist() == [False, True, True, False], ((y - center).abs() / bound).max(dim=1)


def test_routing_uses_every_expert_with_exact_weights() -> None:
    ids, weights = routing(4, 2)
    assert ids.tolist() == [[0, 1], [1, 2], [2, 3], [3, 0]] and ids.dtype == torch.int32
    assert weights.tolist() == [[0.5, 0.25]] * 4
    assert routing(2, 8)[0].tolist() == [[0, 1], [1, 0]]  # never more experts per token than exist


def test_the_interval_is_a_point_away_from_rounding_boundaries_and_covers_both_sides_at_one() -> None:
    a = torch.tensor([1.0, 64 / 127, -32 / 127, 16 / 127], dtype=torch.float64)  # whole units of s = 1/127
    low, high = dequantized_interval(a, torch.bfloat16)
    assert torch.equal(low, high) and torch.allclose(low, a, rtol=1e-15, atol=0)
    tie = torch.tensor([127.0, 1.5], dtype=torch.float64)  # s = 1: 1.5 units, a tie either rounding may take
    low, high = dequantized_interval(tie, torch.bfloat16)
    assert low.tolist() == [127.0, 1.0] and high.tolist() == [127.0, 2.0]
