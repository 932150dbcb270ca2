"""The memory estimate of a full-size config: how long it takes and how much memory it uses.

    python benchmarks/estimate.py [--config engine_ref/model_executor/models/configs/Mixtral-8x7B-v0.1.json]
                                  [--tensor-parallel-size 2] [--device-memory 80GiB] [--max-model-len 32768]
                                  [--repeats 3]

Prints the estimate's table, then:
- the time to import engine_ref's estimate and torch's fake tensors (paid once per process);
- the estimate's wall time (median and min over ``--repeats`` runs, the first one included);
- this process's peak RSS, against the bytes the weights would take if they were allocated.
Mixtral-8x7B (46.7B parameters, 87 GiB of bfloat16 weights) is the default.
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = (Path(__file__).resolve().parent.parent
                  / "engine_ref/model_executor/models/configs/Mixtral-8x7B-v0.1.json")


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    Linux: VmHWM, this process image's own high-water mark (getrusage's ru_maxrss also carries the
    peak of the process that forked this one, across fork and exec).
    """
    status = Path("/proc/self/status")
    if status.exists():
        match = re.search(r"VmHWM:\s+(\d+) kB", status.read_text())
        if match:
            return int(match.group(1)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device-memory", default="80GiB")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    start = time.perf_counter()
    from torch._subclasses.fake_tensor import FakeTensorMode

    from engine_ref.memory.estimate import estimate_memory
    from engine_ref.utils import format_bytes

    FakeTensorMode()  # its first construction imports torch._dynamo
    import_s = time.perf_counter() - start

    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        estimate = estimate_memory(
            args.config, device_memory=args.device_memory, tensor_parallel_size=args.tensor_parallel_size,
            dtype=args.dtype, max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        )
        seconds.append(time.perf_counter() - start)
    peak_rss = peak_rss_bytes()

    print(estimate.format_table())
    print()
    print(f"import (engine_ref estimate, torch fake tensors): {import_s:.2f} s")
    print(f"estimate: median {statistics.median(seconds):.2f} s, min {min(seconds):.2f} s over {args.repeats} runs")
    print(f"peak RSS of this process: {format_bytes(peak_rss)} "
          f"(the weights alone would take {format_bytes(estimate.weight_bytes)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
