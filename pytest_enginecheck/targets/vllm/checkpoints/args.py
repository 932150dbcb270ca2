"""vLLM's arguments a tiny checkpoint needs to be started: each kind of checkpoint says its own.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.composite import engine_args as text_only_args


def checkpoint_args(ckpt: str) -> dict[str, Any]:
    """vLLM's arguments the checkpoint at ``ckpt`` needs: a composite one's text decoder alone
    (``composite.engine_args``), ``trust_remote_code`` for one whose config is the checker's remote config
    (``remote_config.engine_args``), ``skip_tokenizer_init=False`` for one with the checker's tokenizer
    (``tokenizer.engine_args``)."""
    from pytest_enginecheck.targets.vllm.checkpoints import remote_config, tokenizer

    return {**text_only_args(ckpt), **remote_config.engine_args(ckpt), **tokenizer.engine_args(ckpt)}
