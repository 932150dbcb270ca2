"""What each rank computes for the quant check's oracles (run on the workers through ``collective_rpc``): every linear
layer's own product of a fixed input (``local_products``), and every fused MoE layer's experts on a fixed routing
(``expert_products``), before any collective.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.targets.vllm.checks.quant_experts import EXPERT_MODULES, SHARDS, reference, routing

# The local oracle's inputs: each row integers in [-127, 127] times 2^-7, its largest |value| exactly 127 * 2^-7.
# vLLM's dynamic per-token int8 quantization of such a row is exact (scale max|x| / 127 = 2^-7, x / scale an
# integer), and so is every product with a deq(W) of power-of-two scales. int8: an output's K <= 128 products share
# its channel's scale, so every partial sum is a multiple of 2^-7 * scale below 128 * 127 * 127 < 2^24 of those
# units, exact in float32 in any order: a correct layer computes bitwise the unquantized layer's output on deq(W).
# w4a16: the group scales of one output differ, so the float32 sum is exact only while they span less than
# 2^24 / (128 * 127 * 8) = 2^7 (they do on the tiny checkpoints); each kernel then rounds it into bfloat16 once. The
# tolerance (compare_local) is one ulp of the dtype per element, which also covers one rounding that goes the
# other way; measured: every layer, rank and family equal bitwise (0), a scale 5 % off 5e-2.
LOCAL_ROWS = 4
INPUT_UNIT = 2.0**-7


def local_input(name: str, rank: int, rows: int, width: int, dtype: Any) -> Any:
    """The local oracle's input of ``name`` on ``rank`` (``[rows, width]``, the same in every engine)."""
    import zlib

    import torch

    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}:{rank}".encode()))
    q = torch.randint(-127, 128, (rows, width), generator=generator)
    q[torch.arange(rows), torch.arange(rows) % width] = 127
    return (q.to(torch.float32) * INPUT_UNIT).to(dtype)


def local_products(worker: Any, dequantized: str | None = None) -> dict[str, Any]:
    """On each rank (``collective_rpc``): every linear layer's own product (its quant method's ``apply``, before
    any collective, no bias) of ``local_input``, with its quant method's (or scheme's) name, the names of those
    compressed-tensors quantized, and the fused MoE layers by name: their quant method's name, and given the
    ``dequantized`` twin's path what the expert oracle compares (``quant_experts.expert_products``)."""
    import torch

    from pytest_enginecheck.targets.vllm.checks.local_products import expert_products
    from pytest_enginecheck.targets.vllm.checks.quant_experts import EXPERT_MODULES
    from pytest_enginecheck.targets.vllm.probe import worker_model

    model = worker_model(worker)
    dtype = worker.model_config.dtype
    rank = int(getattr(worker, "rank", 0))
    products: dict[str, Any] = {}
    methods: dict[str, str] = {}
    quantized: list[str] = []
    with torch.inference_mode():
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is None or type(module).__name__ in EXPERT_MODULES:
                continue
            width = getattr(module, "input_size_per_partition", None)
            if width is None:  # not a linear layer (an embedding, the lm_head)
                continue
            x = local_input(name, rank, LOCAL_ROWS, int(width), dtype)
            products[name] = method.apply(module, x, None).float().cpu()
            scheme = getattr(module, "scheme", None)  # compressed-tensors' scheme of a quantized layer
            methods[name] = type(scheme).__name__ if scheme is not None else type(method).__name__
            if scheme is not None:
                quantized.append(name)
        moe = expert_products(model, worker, dequantized)
    return {"rank": rank, "dtype": str(dtype), "products": products, "methods": methods, "experts": moe,
            "quantized": quantized}


def checkpoint_names(model: Any, layer: str, moe: Any) -> dict[str, str]:
    """``"expert:shard"`` -> the checkpoint tensor of that expert's gate (w1), up (w3) or down (w2) projection weight
    of the fused MoE layer ``layer``, by the layer's own expert mapping (as vllm_weights splits fused experts)."""
    from pytest_enginecheck.targets.vllm.checkpoints.weight_layout import expert_mapping, unmapped_name

    block = layer[: layer.rfind(".experts.") + 1] if ".experts." in layer else f"{layer.rpartition('.')[0]}."
    names = {}
    for param_part, weight_part, expert, shard in expert_mapping(model, moe):
        if shard not in SHARDS:
            continue
        attr = f"{param_part.rpartition('.')[2]}weight"  # "w13_weight"
        if weight_part.startswith("experts.") and block:
            name = f"{block}{weight_part}weight"
        else:
            name = f"{layer}.{attr}".replace(param_part, weight_part, 1)
        names[f"{expert}:{shard}"] = unmapped_name(model, name)
    return names


def outside_derivation(module: Any, method: Any) -> str | None:
    """What of a fused MoE layer the bound is not derived for (then its experts are not compared), or None: the
    reference computes ``down(silu(gate x) * up x)`` per expert without biases, weighted after the experts."""
    activation = str(getattr(module, "activation", "silu")).lower()
    departures = {
        "expert parallelism": bool(getattr(module, "use_ep", False)),
        "a monolithic kernel (it routes itself)": bool(getattr(method, "is_monolithic", False)),
        f"the activation {activation}": "silu" not in activation or "no_mul" in activation,
        "expert biases": getattr(module, "w13_bias", None) is not None or getattr(module, "w2_bias", None) is not None,
        "router weights applied to the input": bool(getattr(module, "apply_router_weight_on_input", False)),
        "a clamped SwiGLU": getattr(module, "swiglu_limit", None) is not None,
    }
    return next((what for what, applies in departures.items() if applies), None)


def expert_products(model: Any, worker: Any, dequantized: str | None = None) -> dict[str, Any]:
    """On a rank, each fused MoE layer by name: its quant method's name, and given the ``dequantized`` twin's path
    (for quantized layers) its output (the method's ``apply``, no all-reduce) on ``quant.local_input`` with
    ``routing``, with ``reference``'s center and bound (computed here: the check process must start no torch thread
    pool before it forks vLLM's ranks), or why it cannot be checked (``unchecked``)."""
    from safetensors.torch import load_file

    from pytest_enginecheck.targets.vllm.checks.local_products import local_input

    dtype = worker.model_config.dtype
    found: dict[str, Any] = {}
    tensors: dict[str, Any] | None = None
    for name, module in model.named_modules():
        if type(module).__name__ not in EXPERT_MODULES or getattr(module, "quant_method", None) is None:
            continue
        method = module.quant_method
        entry: dict[str, Any] = {"method": type(method).__name__, "rank": int(getattr(worker, "rank", 0))}
        found[name] = entry
        if dequantized is None or entry["method"].startswith("Unquantized"):
            continue
        if (departure := outside_derivation(module, method)) is not None:
            entry["unchecked"] = departure
            continue
        experts = int(module.global_num_experts)
        ids, weights = routing(experts, int(getattr(module, "top_k", 2)))
        x = local_input(name, 0, experts, int(module.hidden_size), dtype)  # the same on every rank
        y = method.apply(module, x, weights, ids, None, None)
        if tensors is None:
            tensors = load_file(f"{dequantized}/model.safetensors")
        shard = (entry["rank"], int(worker.parallel_config.tensor_parallel_size))
        center, bound = reference(x.double(), ids, weights.double(), checkpoint_names(model, name, module), shard,
                                  tensors, dtype)
        entry.update(y=y.double().cpu(), center=center, bound=bound)
    return found
