"""LoRARequest: which adapter a request runs with (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_ref.errors import InputError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: a name, an id unique per adapter (1 or more), a PEFT adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InputError(
                f"LoRARequest {self.lora_name!r} has lora_int_id={self.lora_int_id!r}; give each adapter its own "
                f"integer id of 1 or more (0 and below mean 'no adapter')."
            )
        if not self.lora_name:
            raise InputError(f"LoRARequest with lora_int_id={self.lora_int_id} has an empty lora_name; name it.")
        if not str(self.lora_path):
            raise InputError(f"LoRARequest {self.lora_name!r} has an empty lora_path; pass the adapter's directory.")
