"""``zoo.leftovers_registry:REGISTRY``: what an engine leaves behind, planted beside clean twins
(zoo/planted_leftovers.py, tests/pytest_enginecheck/test_leftovers_every_engine.py). Every bug must fail load[tp=2]
and startup (it runs at the largest TP size) naming what was left; every twin must pass both."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
# a helper process started at the first decode step at TP > 1, never waited for | its twin waits for it
REGISTRY.register_model("DecodeHelperLlamaForCausalLM", "zoo.planted_leftovers:DecodeHelperLlamaForCausalLM")
REGISTRY.register_model("JoinedHelperLlamaForCausalLM", "zoo.planted_leftovers:JoinedHelperLlamaForCausalLM")
# a non-daemon thread started at the first decode step at TP > 1, never stopped | its twin's daemon thread is stopped
REGISTRY.register_model("DecodeThreadLlamaForCausalLM", "zoo.planted_leftovers:DecodeThreadLlamaForCausalLM")
REGISTRY.register_model("StoppedThreadLlamaForCausalLM", "zoo.planted_leftovers:StoppedThreadLlamaForCausalLM")
# a file written at build to a fixed path in /tmp, left there | its twin removes it
REGISTRY.register_model("TmpFileLlamaForCausalLM", "zoo.planted_leftovers:TmpFileLlamaForCausalLM")
REGISTRY.register_model("RemovedTmpFileLlamaForCausalLM", "zoo.planted_leftovers:RemovedTmpFileLlamaForCausalLM")
# the same file as a shared-memory segment in /dev/shm, left there | its twin unlinks it
REGISTRY.register_model("ShmSegmentLlamaForCausalLM", "zoo.planted_leftovers:ShmSegmentLlamaForCausalLM")
REGISTRY.register_model("UnlinkedShmSegmentLlamaForCausalLM",
                        "zoo.planted_leftovers:UnlinkedShmSegmentLlamaForCausalLM")
