"""Tensor parallelism on real CPU ranks: TP=2 and TP=4 give TP=1's and transformers' greedy tokens.

Each architecture's tiny checkpoint runs at TP=1 (in process), TP=2 and TP=4 (one WorkerProc per
rank, gloo) and through transformers' own implementation, the reference no one here wrote. The
same engines prove that each rank reads only its shard of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_ref import LLM
from engine_ref.config import valid_tensor_parallel_sizes
from engine_ref.engine.report import StartupReport
from engine_ref.model_executor.model_loader.checkpoint import example_config
from tests.helpers import ARCHITECTURES, MAX_SHARE_READ_AT_TP2, checkpoint_bytes

ENGINE: dict[str, Any] = {"device_memory": "256MiB", "max_model_len": 64, "max_num_batched_tokens": 64}
MAX_TOKENS = 6
IMAGE_TOKENS = 16  # a 32x32 image in 8x8 patches


def tp_sizes(architecture: str) -> list[int]:
    """TP sizes up to 4 that split this architecture evenly (text and vision)."""
    return valid_tensor_parallel_sizes(example_config(architecture), limit=4)


def prompts_for(architecture: str) -> tuple[list[list[int]], list[torch.Tensor | None] | None]:
    """Two prompts; for Llava the first holds an image (its placeholders) and the second none."""
    if architecture != "LlavaForConditionalGeneration":
        return [[1, 5, 9, 13, 17], [7, 3]], None
    image_token = example_config(architecture)["image_token_index"]
    image = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(0))
    return [[1, *[image_token] * IMAGE_TOKENS, 5, 9], [1, 7, 3]], [image, None]


def run_engine(model: Path, tp: int, prompts: list[list[int]], images: list[torch.Tensor | None] | None
               ) -> tuple[list[list[int]], StartupReport]:
    with LLM(str(model), tensor_parallel_size=tp, **ENGINE) as llm:
        tokens = llm.generate(prompts, max_tokens=MAX_TOKENS, images=images, ignore_eos=True)
        return tokens, llm.startup_report


def transformers_tokens(model: Path, architecture: str, prompts: list[list[int]],
                        images: list[torch.Tensor | None] | None) -> list[list[int]]:
    """Greedy tokens from transformers' implementation, one prompt at a time (no padding)."""
    import transformers

    hf_model = getattr(transformers, architecture).from_pretrained(str(model)).eval()
    tokens = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            image = images[i] if images else None
            extra = {} if image is None else {"pixel_values": image[None]}
            out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, min_new_tokens=MAX_TOKENS, max_new_tokens=MAX_TOKENS, **extra)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tp_matches_tp1_and_transformers(architecture: str, tiny_checkpoint: Callable[..., Path]) -> None:
    model = tiny_checkpoint(architecture)
    prompts, images = prompts_for(architecture)
    sizes = tp_sizes(architecture)
    assert 2 in sizes, f"{architecture}'s example config cannot run at TP=2"

    results = {tp: run_engine(model, tp, prompts, images) for tp in sizes}
    expected = transformers_tokens(model, architecture, prompts, images)

    for tp, (tokens, report) in results.items():
        assert tokens == expected, f"TP={tp} of {architecture} differs from transformers"
        assert report.tensor_parallel_size == tp
        assert [w.rank for w in report.workers] == list(range(tp))
    assert len({w.pid for w in results[2][1].workers}) == 2, "TP=2 ranks must be two processes"


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_each_rank_reads_only_its_shard(architecture: str, tiny_checkpoint: Callable[..., Path]) -> None:
    """At TP=2 a rank reads about half of the checkpoint; the ranks together read all of it."""
    model = tiny_checkpoint(architecture)
    total = checkpoint_bytes(model)
    with LLM(str(model), tensor_parallel_size=2, load_format="safetensors", **ENGINE) as llm:
        read = [w.bytes_read for w in llm.startup_report.workers]
    for rank, n in enumerate(read):
        assert n <= MAX_SHARE_READ_AT_TP2 * total, (
            f"rank {rank} read {n} of {total} checkpoint bytes ({n / total:.1%}); a rank should read its shard only")
    assert sum(read) >= total, f"the ranks read {sum(read)} bytes together, less than the checkpoint's {total}"
