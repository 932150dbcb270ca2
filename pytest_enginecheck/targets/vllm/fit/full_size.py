"""Which full-size config.json an architecture has, for budget[tp=N]'s fit on ``--enginecheck-device-memory``
(``checks/full_size.py``): ``--enginecheck-full-size-configs`` (``Arch=path`` pairs, comma
separated, or the path of a JSON file mapping architecture -> path; its ini twin ``enginecheck_full_size_configs``),
else what its class declares in ``enginecheck_full_size_config`` (a path, absolute or relative to the file of the
class's module: the published config travels with the author's distribution, as ``enginecheck_config`` does).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from pytest_enginecheck.targets import TargetOption

FULL_SIZE_ATTRIBUTE = "enginecheck_full_size_config"
FULL_SIZE_CONFIGS = TargetOption(
    "full_size_configs", default="", metavar="MAPPING",
    help="the full-size config.json of each vLLM architecture whose fit on --enginecheck-device-memory budget[tp=N] "
         "asserts: 'Arch=path' pairs, comma separated, or a JSON file mapping architecture -> path (default: what "
         f"each class declares in {FULL_SIZE_ATTRIBUTE})")


class FullSizeConfigError(Exception):
    """The full-size config mapping or declaration is not usable; the message names the value and the fix."""


def parse_mapping(value: str) -> dict[str, Path]:
    """``--enginecheck-full-size-configs``: 'Arch=path,...' or a JSON file of {architecture: path} (paths in the
    file relative to it)."""
    value = value.strip()
    if not value:
        return {}
    fix = "give 'LlamaForCausalLM=configs/llama-70b.json,...' or a JSON file mapping architecture -> path"
    if "=" not in value:
        file = Path(value)
        try:
            mapping = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise FullSizeConfigError(f"--enginecheck-full-size-configs={value!r}: not a readable JSON file ({e}); "
                                      f"{fix}") from None
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise FullSizeConfigError(f"--enginecheck-full-size-configs={value!r}: the file is not a JSON object of "
                                      f"paths; {fix}")
        return {arch: file.parent / path for arch, path in mapping.items()}
    pairs = [part.split("=", 1) for part in value.split(",") if part.strip()]
    if any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
        raise FullSizeConfigError(f"--enginecheck-full-size-configs={value!r}: {fix}")
    return {arch.strip(): Path(path.strip()) for arch, path in pairs}


def full_size_config(architecture: str, mapping: dict[str, Path], model_cls: type | None) -> Path | None:
    """The architecture's full-size config.json: the option's mapping first, else its class's declaration."""
    if architecture in mapping:
        return mapping[architecture]
    declared = getattr(model_cls, FULL_SIZE_ATTRIBUTE, None) if model_cls is not None else None
    if declared is None:
        return None
    if not isinstance(declared, (str, Path)):
        raise FullSizeConfigError(f"{architecture}.{FULL_SIZE_ATTRIBUTE} is {declared!r}: set it to the path of the "
                                  f"model's published config.json (absolute, or relative to its module's file)")
    path = Path(declared)
    if not path.is_absolute():
        source = inspect.getsourcefile(model_cls) if model_cls is not None else None
        path = Path(source).parent / path if source else path
    return path
