"""LLM: the offline entry point, as in vLLM: ``LLM(model=DIR).generate(prompt_token_ids=[...])``."""

from __future__ import annotations

import itertools
from dataclasses import fields
from types import TracebackType
from typing import Any

import torch

from engine_ref.engine.arg_utils import EngineArgs
from engine_ref.engine.core import EngineCore
from engine_ref.engine.report import StartupReport
from engine_ref.engine.scheduler import Request
from engine_ref.errors import EngineDeadError, InputError
from engine_ref.lora.request import LoRARequest


class LLM:
    """A started engine you can generate with; use it as a context manager or call ``shutdown()``."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        self.engine = EngineCore(EngineArgs(model=str(model), **kwargs))
        self._ids = itertools.count()

    @property
    def startup_report(self) -> StartupReport:
        return self.engine.startup_report

    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int = 16,
                 images: list[torch.Tensor | None] | None = None, ignore_eos: bool = False,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[list[int]]:
        """Greedy-decode up to ``max_tokens`` tokens for each prompt; return the new token ids per prompt.

        ``images`` (one entry per prompt, or None) feed multimodal models: a ``[3, H, W]`` or
        ``[n, 3, H, W]`` tensor for prompts that hold image placeholder tokens. ``lora_request``
        (an engine started with ``enable_lora=True``): one adapter for every prompt, or one entry per
        prompt (None: the base model); each adapter is read on every rank before any prompt runs.
        """
        if self.engine.executor.is_shutdown:
            raise EngineDeadError("this LLM was shut down; create a new LLM(...) to generate again.")
        model_config = self.engine.config.model_config
        vocab_size = model_config.hf_text_config.vocab_size
        max_len = model_config.max_model_len
        eos = None if ignore_eos else model_config.hf_text_config.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if images is not None and len(images) != len(prompt_token_ids):
            raise InputError(f"{len(images)} images entries for {len(prompt_token_ids)} prompts; give one per prompt.")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InputError(f"max_tokens={max_tokens!r} must be a positive integer.")
        loras = self._lora_requests(lora_request, len(prompt_token_ids))
        requests = []
        for i, prompt in enumerate(prompt_token_ids):
            if not isinstance(prompt, (list, tuple)):
                raise InputError(f"prompt {i} is a {type(prompt).__name__}, not a list of token ids; pass "
                                 f"prompt_token_ids=[[...], ...], one list per prompt.")
            if not prompt:
                raise InputError(f"prompt {i} is empty; give at least one token id.")
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise InputError(f"prompt {i} holds token ids outside [0, {vocab_size}): {bad[:5]}.")
            if len(prompt) + max_tokens > max_len:
                raise InputError(
                    f"prompt {i} has {len(prompt)} tokens; with max_tokens={max_tokens} it needs "
                    f"{len(prompt) + max_tokens} positions, more than max_model_len={max_len}. "
                    f"Shorten the prompt or lower max_tokens."
                )
            pixels = images[i] if images is not None else None
            requests.append(Request(next(self._ids), list(prompt), max_tokens, eos, pixels, loras[i]))
        for lora in dict.fromkeys(r for r in loras if r is not None):
            self.engine.add_lora(lora)
        for request in requests:
            self.engine.add_request(request)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return [r.output_token_ids for r in requests]

    def _lora_requests(self, lora_request: LoRARequest | list[LoRARequest | None] | None,
                       num_prompts: int) -> list[LoRARequest | None]:
        """``generate``'s lora_request as one entry per prompt, checked."""
        if lora_request is None:
            return [None] * num_prompts
        if self.engine.config.lora_config is None:
            raise InputError("lora_request was given, but this LLM was started without LoRA; start it with "
                             "LLM(..., enable_lora=True) (--enable-lora).")
        if isinstance(lora_request, LoRARequest):
            return [lora_request] * num_prompts
        if not isinstance(lora_request, (list, tuple)) or len(lora_request) != num_prompts:
            given = f"a list of {len(lora_request)}" if isinstance(lora_request, (list, tuple)) else \
                f"a {type(lora_request).__name__}"
            raise InputError(f"lora_request is {given} for {num_prompts} prompts; pass one LoRARequest for every "
                             f"prompt, or a list with one LoRARequest (or None) per prompt.")
        bad = [i for i, r in enumerate(lora_request) if r is not None and not isinstance(r, LoRARequest)]
        if bad:
            raise InputError(f"lora_request[{bad[0]}] is a {type(lora_request[bad[0]]).__name__}, not a LoRARequest; "
                             f"pass LoRARequest(lora_name, lora_int_id, lora_path) or None.")
        return list(lora_request)

    def shutdown(self) -> None:
        """Stop the engine's workers. Idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()
