"""DeviceConfig: the device and its memory (simulated on CPU)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_ref.errors import ConfigError
from engine_ref.utils import parse_size

DEVICES = ("cpu", "cuda")
DEFAULT_CPU_DEVICE_MEMORY = "4GiB"


@dataclass
class DeviceConfig:
    """The device and its memory. On CPU the memory is simulated: a capacity such as "8GiB"."""

    device: str = "cpu"
    device_memory: str | int | None = None
    capacity_bytes: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is unknown; use 'cpu' or 'cuda'.")
        if self.device == "cpu" and self.device_memory is None:
            self.device_memory = DEFAULT_CPU_DEVICE_MEMORY
        if self.device_memory is not None:
            self.capacity_bytes = parse_size(self.device_memory, "device_memory")
