"""The bundled model zoo. Importing this package imports no model module (and no torch)."""

from engine_ref.model_executor.models.interfaces import ModelInfo
from engine_ref.model_executor.models.registry import ModelRegistry

__all__ = ["ModelInfo", "ModelRegistry"]
