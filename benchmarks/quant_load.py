"""Load time and bytes read per rank: an unquantized checkpoint against quantized ones, side by side.

    python benchmarks/quant_load.py [--architecture LlamaForCausalLM] [--methods fp8,int8] [--tp 1,2]
                                    [--repeats 3] [--override hidden_size=512 ...]

For each TP size, starts the engine (``LLM``) on:
- the unquantized float32 checkpoint;
- the same checkpoint with ``quantization=METHOD`` (converted at startup: reads the float32 weights);
- its pre-quantized twin (``make_quantized_checkpoint``: reads 8-bit weights and scales);
and prints, per variant, the median ``load_model`` phase of the slowest rank over ``--repeats``
starts, the bytes each rank read, the weight bytes each rank holds, and both as ratios to the
unquantized load. The default model is the architecture's example config widened (``--override``)
so that loading takes measurable time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_OVERRIDES = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "vocab_size": 4096,
                     "num_attention_heads": 8, "num_key_value_heads": 4}


def measure(model: Path, tp: int, repeats: int, **kwargs: Any) -> tuple[float, list[int], list[int]]:
    """(median seconds of the slowest rank's load_model, bytes read per rank, weight bytes per rank)."""
    from engine_ref.entrypoints.llm import LLM

    seconds, report = [], None
    for _ in range(repeats):
        with LLM(str(model), tensor_parallel_size=tp, device_memory="2GiB", max_model_len=64,
                 max_num_batched_tokens=64, **kwargs) as llm:
            report = llm.startup_report
        seconds.append(max(w.phases["load_model"] for w in report.workers))
    assert report is not None
    return statistics.median(seconds), [w.bytes_read for w in report.workers], [w.memory.weights for w in
                                                                                 report.workers]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", default="LlamaForCausalLM")
    parser.add_argument("--methods", default="fp8,int8")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help=f"config.json fields (JSON values) over the example config (default: {DEFAULT_OVERRIDES})")
    args = parser.parse_args()
    overrides = dict(DEFAULT_OVERRIDES) if not args.override else {}
    for item in args.override:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)

    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint
    from engine_ref.model_executor.model_loader.quantized_checkpoint import make_quantized_checkpoint
    from engine_ref.utils import format_bytes

    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory(prefix="quant_load-") as tmp:
        base = make_checkpoint(args.architecture, Path(tmp) / "base", overrides=overrides)
        twins = {m: make_quantized_checkpoint(args.architecture, Path(tmp) / m, m, overrides=overrides)
                 for m in methods}
        print(f"{args.architecture} {overrides}, float32 checkpoint, median of {args.repeats} starts\n")
        print(f"{'tp':>3}  {'variant':<27}{'load s':>9}{'x':>7}  {'read per rank':>16}{'x':>7}  "
              f"{'weights per rank':>17}{'x':>7}")
        for tp in (int(t) for t in args.tp.split(",")):
            variants = {"unquantized": (base, {})}
            for m in methods:
                variants[f"{m} converted at startup"] = (base, {"quantization": m})
                variants[f"{m} pre-quantized"] = (twins[m], {})
            first: tuple[float, list[int], list[int]] | None = None
            for name, (model, kwargs) in variants.items():
                seconds, read, weights = measure(model, tp, args.repeats, **kwargs)
                first = first or (seconds, read, weights)
                print(f"{tp:>3}  {name:<27}{seconds:>9.4f}{seconds / first[0]:>7.2f}  {format_bytes(read[0]):>16}"
                      f"{read[0] / first[1][0]:>7.2f}  {format_bytes(weights[0]):>17}{weights[0] / first[2][0]:>7.2f}")
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
