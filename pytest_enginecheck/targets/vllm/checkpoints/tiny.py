"""The tiny-checkpoint factory: each architecture's checkpoint made once per session, by transformers where it can,
else from vLLM's model (``from_transformers.make_tiny_checkpoint``), and the reason kept where none can be made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from pytest_enginecheck.targets.vllm.checkpoints.from_transformers import foreign_base, hf_class, make_hf_checkpoint
from pytest_enginecheck.targets.vllm.checkpoints.from_vllm import make_vllm_checkpoint
from pytest_enginecheck.targets.vllm.checkpoints.shrink import NoTinyCheckpoint


def make_tiny_checkpoint(architecture: str, path: Path, model_cls: type | None = None) -> Path:
    """Write the tiny checkpoint of ``architecture`` to ``path`` (config.json + model.safetensors): transformers'
    (``from_transformers``) where it has the architecture's class, or a base class's whose config is its; else
    vLLM's config class with weights from vLLM's model (``from_vllm``)."""
    try:
        no_class = foreign_base(architecture, model_cls, hf_class(architecture, model_cls))
    except NoTinyCheckpoint as e:
        no_class = str(e)
    if no_class:  # outside the except block: what its fork raises is then not chained to this, and limits.py finds
        # the frame that raised it
        return make_vllm_checkpoint(architecture, path, model_cls, reason=no_class)
    return make_hf_checkpoint(architecture, path, model_cls)


CHECKPOINTS_DIR = "vllm-checkpoints"  # in the session's workdir: the tiny checkpoints the checker wrote


def is_tiny_checkpoint(path: str | Path, workdir: str) -> bool:
    """Whether ``path`` is (in) a tiny checkpoint the checker wrote in ``workdir`` (``tiny_checkpoint``)."""
    return (Path(workdir) / CHECKPOINTS_DIR).resolve() in Path(path).resolve().parents


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread meanwhile. The check child that makes a checkpoint then forks vLLM's ranks
    (engine.py), and a fork of a process whose OpenMP pool ran deadlocks in its first parallel torch op: a tensor
    above ATen's grain size (32768 elements: a vision patch embedding, an audio encoder's 1500 positions) starts
    that pool, and rank 0 hung in the rotary cache of PaliGemma's text model until the check's timeout."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def made_once(path: Path, marker: str, make: Callable[[Path], object]) -> Path:
    """``path``, made by ``make(dir)`` in a temp dir beside it and renamed into place, once: the processes of a
    session (pytest-xdist workers, check children) share it, the first rename wins, and ``path / marker`` exists
    only when it is whole."""
    if (path / marker).exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        make(tmp)
        os.replace(tmp, path)
    except OSError:  # another process of this session made it first
        if not (path / marker).exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_checkpoint(architecture: str, workdir: str, model_cls: type | None = None) -> Path:
    """The architecture's tiny checkpoint under ``workdir``, made once (``made_once``); where none can be made, the
    reason is kept beside it, so the session's other items skip at once instead of trying again (a vLLM-side
    attempt costs a fork that builds vLLM's model)."""

    def make(tmp: Path) -> None:
        with _one_torch_thread():
            make_tiny_checkpoint(architecture, tmp, model_cls)

    path = Path(workdir) / CHECKPOINTS_DIR / architecture
    refused = path.with_name(f".{architecture}.no-tiny-checkpoint")
    if refused.exists():
        raise NoTinyCheckpoint(refused.read_text())
    try:
        return made_once(path, "config.json", make)
    except NoTinyCheckpoint as e:
        partial = refused.with_name(f"{refused.name}.{os.getpid()}")
        partial.write_text(str(e))
        partial.replace(refused)  # whole or not at all: another process may read it now
        raise
