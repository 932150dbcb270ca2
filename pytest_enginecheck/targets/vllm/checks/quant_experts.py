"""The quant check's oracle for fused MoE experts that run quantized (int8 W8A8 on a CPU with AMX tiles, where vLLM
0.32 picks ``CPUExpertsInt8``: the SGL kernel ``fused_experts_cpu``).

On each rank (``expert_products``), every quantized expert layer's own computation (its quant method's ``apply``,
before the all-reduce) on a fixed input ``x`` with a fixed routing: token ``t`` goes to experts ``t, t+1, ...``
(mod E) with weights 1/2, 1/4, ..., so every expert is used. The same input is given to the experts of the
dequantized twin here, in float64 (``reference``), with the rank's shard of each expert (TP splits the intermediate
dimension: rows of gate/up, columns of down), and the kernel's result must fall within a bound derived from what
the scheme does, not measured:

- ``x`` is the local oracle's input (``quant.local_input``): its per-token int8 quantization is exact, and so is the
  int32 product with the int8 weights: the kernel's gate/up outputs equal the float64 ones but for float32's rounding.
- the intermediate ``a = silu(gate) * up`` is held in the model's dtype (one rounding) and then quantized per token
  to int8 (``q = round(a / s)``, ``s = max|a| / 127``). Near a rounding boundary the kernel's float32 ``a`` (exp's
  approximation included, ``REL``) may round either way: each element's ``q * s`` is an interval over those choices
  (``dequantized_interval``), almost always one point.
- the down projection of ``q`` is an exact int32 sum; each expert's output times its weight is rounded into the dtype,
  and their sum once more: at most half an ulp each, ``u * (sum_e |w_e y_e| + |y|)`` with ``u = eps / 2``.

So ``|kernel - center| <= radius + u * (magnitude + |center| + radius)`` holds for a correct kernel (measured on the
tiny Mixtral at TP 1 and 2: at most 0.94 of the bound), and a weight or scale loaded, sharded or repacked wrongly
moves its expert's outputs by far more (layer 1's expert 2's down projection scale 5 % off: every token that
expert serves, ~20x the bound).
"""

from __future__ import annotations

from typing import Any

# vLLM's fused-MoE layers: RoutedExperts holds the experts since vLLM split it out of FusedMoE
EXPERT_MODULES = ("FusedMoE", "SharedFusedMoE", "RoutedExperts")
# How far (relative) the kernel's float32 intermediate may be from the exact one: float32's roundings and the
# vectorised exp's (ATen's exp_u20, 20 float32 ulps = 1.2e-6), with a margin.
REL = 2.0**-16
SHARDS = ("w1", "w3", "w2")  # gate, up, down: vLLM's expert mapping names the checkpoint's projections so


def routing(num_experts: int, top_k: int) -> tuple[Any, Any]:
    """The fixed routing: one token per expert, token ``t`` to experts ``t, t+1, ...`` with weights 2^-1, 2^-2, ...
    (exact in every dtype): ``topk_ids`` ``[E, k]`` (int32, as vLLM's router gives them) and ``topk_weights``."""
    import torch

    k = min(top_k, num_experts)
    ids = torch.tensor([[(t + j) % num_experts for j in range(k)] for t in range(num_experts)], dtype=torch.int32)
    weights = torch.tensor([[2.0 ** -(j + 1) for j in range(k)]] * num_experts, dtype=torch.float32)
    return ids, weights


def dequantized_interval(a: Any, dtype: Any) -> tuple[Any, Any]:
    """Per element of the intermediate ``a`` (float64, exact), the least and largest ``q * s`` the kernel can hold:
    ``a`` rounded into ``dtype`` and quantized per token to int8, over its float32 value's leeway (``REL``), the
    scale that follows and either rounding of a tie."""
    import torch

    held = [(a * (1 + f)).float().to(dtype).double() for f in (-REL, REL)]
    largest = [h.abs().max() for h in held]
    scales = [min(largest) / 127, max(largest) / 127]
    values = [torch.round(h / s * (1 + f)) * s for h in held for s in scales for f in (-1e-6, 1e-6)]
    stacked = torch.stack(values)
    return stacked.min(0).values, stacked.max(0).values


def reference(x: Any, ids: Any, weights: Any, names: dict[str, str], shard: tuple[int, int],
              tensors: dict[str, Any], dtype: Any) -> tuple[Any, Any]:
    """The dequantized twin's experts (``tensors``, by ``checkpoint_names``) on the rank's ``shard`` (rank, TP size)
    for the tokens ``x`` routed by ``ids``/``weights`` (float64): the center of what a correct kernel computes, and
    the bound around it (the module's docstring)."""
    import torch

    rank, tp = shard
    center = torch.zeros(x.shape, dtype=torch.float64)
    radius, magnitude = torch.zeros_like(center), torch.zeros_like(center)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, w = int(ids[t, j]), weights[t, j]
            gate, up, down = (tensors[names[f"{e}:{s}"]].double() for s in SHARDS)
            part = gate.shape[0] // tp
            rows = slice(rank * part, (rank + 1) * part)
            a = torch.nn.functional.silu(gate[rows] @ x[t]) * (up[rows] @ x[t])
            low, high = dequantized_interval(a, dtype)
            out = w * (down[:, rows] @ ((low + high) / 2))
            center[t] += out
            radius[t] += w * (down[:, rows].abs() @ ((high - low) / 2))
            magnitude[t] += out.abs()
    u = torch.finfo(dtype).eps / 2
    return center, radius + u * (magnitude + center.abs() + radius)


def compare_experts(captures: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float, list[str]]:
    """Per rank and fused MoE layer (``expert_products``' captures), whether its output falls within the bound around
    the dequantized twin's: the layers outside it (largest excess first, with the least-squares ratio to the
    center), the largest error as a fraction of its bound, and the layers no oracle checks (with why)."""
    found: list[dict[str, Any]] = []
    unchecked: list[str] = []
    largest = 0.0
    for capture in captures:
        for name, layer in capture["experts"].items():
            if "unchecked" in layer:
                unchecked.append(f"{name} ({layer['unchecked']})")
                continue
            y, center, bound = layer["y"], layer["center"], layer["bound"]
            share = float(((y - center).abs() / bound.clamp(min=1e-300)).max())
            largest = max(largest, share)
            if share > 1:
                found.append({"name": name, "rank": layer["rank"], "method": layer["method"],
                              "relative_error": float((y - center).norm() / center.norm().clamp(min=1e-300)),
                              "bound_share": share,
                              "ratio": float((y * center).sum() / (center * center).sum().clamp(min=1e-300))})
    return sorted(found, key=lambda d: -d["bound_share"]), largest, sorted(set(unchecked))
