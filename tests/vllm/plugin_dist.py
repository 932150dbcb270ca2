"""A real out-of-tree vLLM plugin distribution, written to a temporary site dir (dist-info with
entry_points.txt, as pip installs it): each entry point is one case the vLLM checks must judge."""

from __future__ import annotations

from pathlib import Path

DIST = "enginecheck-vllm-testplugins"
CUDA_PKG_DIST = "enginecheck-vllm-cudapkg"

ENTRY_POINTS = {
    "clean": "ectp.entry:register_clean",
    "cuda_chain": "ectp.entry:register_cuda_chain",
    "class_registered": "ectp.entry:register_class",
    "raising": "ectp.entry:register_raising",
    "bad_shard": "ectp.entry:register_bad_shard",
    "hungry": "ectp.entry:register_hungry",
}

_LLAMA = "from vllm.model_executor.models.llama import LlamaForCausalLM\n\n\n"

SOURCES = {
    "ectp/__init__.py": "",
    "ectp/entry.py": '''\
def register_clean():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpCleanForCausalLM", "ectp.models.clean:EctpCleanForCausalLM")


def register_cuda_chain():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpCudaForCausalLM", "ectp.models.cuda_model:EctpCudaForCausalLM")


def register_class():
    from vllm import ModelRegistry

    from ectp.models.class_registered import EctpClassForCausalLM

    ModelRegistry.register_model("EctpClassForCausalLM", EctpClassForCausalLM)


def register_raising():
    raise RuntimeError("ectp: the raising plugin cannot find its configuration")


def register_bad_shard():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpBadShardForCausalLM", "ectp.models.bad_shard:EctpBadShardForCausalLM")


def register_hungry():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpHungryForCausalLM", "ectp.models.hungry:EctpHungryForCausalLM")
''',
    "ectp/models/__init__.py": "",
    "ectp/models/clean.py": _LLAMA + "class EctpCleanForCausalLM(LlamaForCausalLM):\n    pass\n",
    "ectp/models/class_registered.py": _LLAMA + "class EctpClassForCausalLM(LlamaForCausalLM):\n    pass\n",
    "ectp/models/cuda_model.py": _LLAMA + "from ectp.models import cuda_helper  # noqa: F401\n\n\n"
                                 "class EctpCudaForCausalLM(LlamaForCausalLM):\n    pass\n",
    "ectp/models/cuda_helper.py": "import torch\n\nDEVICE_NAME = torch.cuda.get_device_name(0)\n",
    "ectp/models/bad_shard.py": _LLAMA + '''\
from vllm.distributed import get_tensor_model_parallel_world_size


def _without_rank_offset(name, weight):
    # The bug under test: every rank loads rank 0's input slice of the row-parallel o_proj.
    tp = get_tensor_model_parallel_world_size()
    if name.endswith("o_proj.weight") and tp > 1:
        return weight[:, : weight.shape[1] // tp].repeat(1, tp)
    return weight


class EctpBadShardForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights):
        return super().load_weights((name, _without_rank_offset(name, w)) for name, w in weights)
''',
    "ectp/models/hungry.py": "import torch\n\n" + _LLAMA + '''\
class EctpHungryForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.register_buffer("lookup_table", torch.zeros(8 * 1024 * 1024), persistent=False)  # 32 MiB
''',
    "ectp_cudapkg/__init__.py": "import torch\n\nHAS_GPU = torch.cuda.device_count() > 0\n\n\n"
                                "def register():\n    pass\n",
}


def _dist_info(site: Path, name: str, entry_points: dict[str, str]) -> None:
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{lines}")


def write_plugin_site(site: Path) -> Path:
    """Write both test distributions (sources and dist-info) into ``site``; return it."""
    for relative, text in SOURCES.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _dist_info(site, DIST, ENTRY_POINTS)
    _dist_info(site, CUDA_PKG_DIST, {"cudapkg": "ectp_cudapkg:register"})
    return site


# Issue 17 item 4: a TP bug in layer 1 (not layer 0) that the load check's diagnosis must name.
ENTRY_POINTS["layer1_shard"] = "ectp.layer1_shard:register"
SOURCES["ectp/layer1_shard.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpLayer1ShardForCausalLM", "ectp.models.layer1_shard:EctpLayer1ShardForCausalLM")
'''
SOURCES["ectp/models/layer1_shard.py"] = _LLAMA + '''\
from vllm.distributed import get_tensor_model_parallel_world_size


def _rank0_columns(name, weight):
    # The bug under test: layer 1's row-parallel down_proj gives every rank rank 0's input columns.
    tp = get_tensor_model_parallel_world_size()
    if name == "model.layers.1.mlp.down_proj.weight" and tp > 1:
        return weight[:, : weight.shape[1] // tp].repeat(1, tp)
    return weight


class EctpLayer1ShardForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights):
        return super().load_weights((name, _rank0_columns(name, w)) for name, w in weights)
'''


# Issue 17 item 5: layer 1 keeps a 12 MiB workspace alive through a view while it allocates a second one
# (true activation peak > 24 MiB; a tracker that drops a storage with its first tensor counted 12); the twin
# lets go of the view first. Both run under vLLM's inference_mode dummy run.
ENTRY_POINTS["workspace_view"] = "ectp.workspace:register_view"
ENTRY_POINTS["workspace"] = "ectp.workspace:register_twin"
SOURCES["ectp/workspace.py"] = '''\
def register_view():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpWorkspaceViewForCausalLM", "ectp.models.workspace:EctpWorkspaceViewForCausalLM")


def register_twin():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpWorkspaceForCausalLM", "ectp.models.workspace:EctpWorkspaceForCausalLM")
'''
SOURCES["ectp/models/workspace.py"] = "import torch\n" + _LLAMA + '''\
from vllm.model_executor.models.llama import LlamaDecoderLayer

WORKSPACE_FLOATS = 3 * 1024 * 1024  # 12 MiB of float32


class _WorkspaceLayer(LlamaDecoderLayer):
    keeps_view = False

    def __init__(self, vllm_config, prefix="", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.uses_workspace = prefix.endswith(".layers.1")

    def forward(self, positions, hidden_states, residual):
        if self.uses_workspace:
            workspace = torch.zeros(WORKSPACE_FLOATS)
            flat = workspace.view(-1)
            del workspace
            if not self.keeps_view:
                del flat
                flat = torch.zeros(1)
            staging = torch.zeros(WORKSPACE_FLOATS)  # the bug: `flat` still holds the first 12 MiB
            hidden_states = hidden_states + 0.0 * (flat.sum() + staging.sum())  # no new view of either
            del flat, staging
        return super().forward(positions, hidden_states, residual)


class _KeptViewLayer(_WorkspaceLayer):
    keeps_view = True


class EctpWorkspaceViewForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_KeptViewLayer)


class EctpWorkspaceForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_WorkspaceLayer)
'''

# Issue 17 item 6: a helper module shared by model modules asks torch.cuda.is_available() at import (cuInit on a
# GPU host): --enginecheck-strict must fail the import check even where the warm parent preloaded the helper.
# The twin's helper asks only when called.
ENTRY_POINTS["gpu_probe"] = "ectp.gpu_probe:register"
SOURCES["ectp/gpu_probe.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpGpuProbeForCausalLM", "ectp.models.gpu_probe_model:EctpGpuProbeForCausalLM")
    ModelRegistry.register_model("EctpLazyProbeForCausalLM", "ectp.models.lazy_probe_model:EctpLazyProbeForCausalLM")
'''
SOURCES["ectp/models/gpu_probe.py"] = "import torch\n\nHAS_GPU = torch.cuda.is_available()\n"
SOURCES["ectp/models/lazy_probe.py"] = ("import functools\n\nimport torch\n\n\n@functools.cache\ndef has_gpu():\n"
                                        "    return torch.cuda.is_available()\n")
SOURCES["ectp/models/gpu_probe_model.py"] = ("from ectp.models import gpu_probe  # noqa: F401\n" + _LLAMA +
                                             "class EctpGpuProbeForCausalLM(LlamaForCausalLM):\n    pass\n")
SOURCES["ectp/models/lazy_probe_model.py"] = ("from ectp.models import lazy_probe  # noqa: F401\n" + _LLAMA +
                                              "class EctpLazyProbeForCausalLM(LlamaForCausalLM):\n    pass\n")

# Issue 17, the load check's oracle: layer 1's row-parallel o_proj gives rank 1 its own input columns scaled by
# 1.01. A sharding bug this small keeps every greedy token of the tiny (nearly flat) model, so only a comparison
# of the log-probabilities catches it.
ENTRY_POINTS["scaled_shard"] = "ectp.scaled_shard:register"
SOURCES["ectp/scaled_shard.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpScaledShardForCausalLM", "ectp.models.scaled_shard:EctpScaledShardForCausalLM")
'''
SOURCES["ectp/models/scaled_shard.py"] = _LLAMA + '''\
from vllm.distributed import get_tensor_model_parallel_world_size


def _rank1_scaled(name, weight):
    # The bug under test: rank 1's input columns of layer 1's row-parallel o_proj come out 1 % too large.
    tp = get_tensor_model_parallel_world_size()
    if name == "model.layers.1.self_attn.o_proj.weight" and tp > 1:
        shard = weight.shape[1] // tp
        weight = weight.clone()
        weight[:, shard : 2 * shard] *= 1.01
    return weight


class EctpScaledShardForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights):
        return super().load_weights((name, _rank1_scaled(name, w)) for name, w in weights)
'''

# Issue 31, load[tp=1]'s reference oracle on vLLM: a Llama whose layer 1 input norm is applied with a weight 1 %
# too large (the same at every TP size, seed and run: only a comparison with transformers' Llama, the reference it
# declares, sees it), and its clean twin that declares the same reference.
ENTRY_POINTS["reference_bug"] = "ectp.reference_bug:register"
SOURCES["ectp/reference_bug.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpNormScaleForCausalLM", "ectp.models.reference_bug:EctpNormScaleForCausalLM")
    ModelRegistry.register_model("EctpRefTwinForCausalLM", "ectp.models.reference_bug:EctpRefTwinForCausalLM")
'''
SOURCES["ectp/models/reference_bug.py"] = _LLAMA + '''\
def _norm_scaled(name, weight):
    if name == "model.layers.1.input_layernorm.weight":
        return weight * 1.01
    return weight


class EctpNormScaleForCausalLM(LlamaForCausalLM):
    enginecheck_reference = "LlamaForCausalLM"

    def load_weights(self, weights):
        return super().load_weights((name, _norm_scaled(name, w)) for name, w in weights)


class EctpRefTwinForCausalLM(LlamaForCausalLM):
    enginecheck_reference = "LlamaForCausalLM"
'''

# Issue 19 item 3, the lora check on vLLM: two LoRA bugs in layer 1, each of a Llama whose base weights load as they
# should. lora_swap: the model's hf_to_vllm_mapper (which, for Llama, vLLM applies to LoRA adapter names only) sends
# layer 1's gate_proj adapter to up_proj and the reverse: the same at every TP size, so only transformers + PEFT
# catches it. lora_shard: layer 1's gate_up_proj is a layer class of the model's own with its own LoRA wrapper, whose
# slice_lora_b gives every rank rank 0's rows of B: wrong only at TP>1. lora_shard_twin: the same wrapper, slicing
# as vLLM's does. The swap bug and the twin declare transformers' Llama their reference (lora[tp=1] holds a model to
# its reference, never to a base class's); the shard bug declares none, so its lora[tp=1] is held to itself.
ENTRY_POINTS["lora_bugs"] = "ectp.lora_bugs:register"
SOURCES["ectp/lora_bugs.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpLoraSwapForCausalLM", "ectp.models.lora_swap:EctpLoraSwapForCausalLM")
    ModelRegistry.register_model("EctpLoraShardForCausalLM", "ectp.models.lora_shard:EctpLoraShardForCausalLM")
    ModelRegistry.register_model("EctpLoraShardTwinForCausalLM", "ectp.models.lora_shard:EctpLoraShardTwinForCausalLM")
'''
SOURCES["ectp/models/lora_swap.py"] = "import re\n\n" + _LLAMA + '''\
from vllm.model_executor.models.utils import WeightsMapper


def _swapped(match):
    # The bug under test: layer 1's adapter for gate_proj is applied to up_proj, and up_proj's to gate_proj.
    return match.group(1) + ("up" if match.group(2) == "gate" else "gate") + "_proj"


class EctpLoraSwapForCausalLM(LlamaForCausalLM):
    enginecheck_reference = "LlamaForCausalLM"
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_regex={re.compile(r"(layers[.]1[.]mlp[.])(gate|up)_proj"): _swapped})
'''
SOURCES["ectp/models/lora_shard.py"] = _LLAMA + '''\
import vllm.lora.utils
from vllm.lora.layers import MergedColumnParallelLinearWithLoRA
from vllm.model_executor.layers.linear import MergedColumnParallelLinear
from vllm.model_executor.models.llama import LlamaDecoderLayer


class Layer1GateUp(MergedColumnParallelLinear):
    """Layer 1's gate_up_proj under a class of this model's own, which vLLM's generic LoRA wrapper leaves alone."""


class Layer1GateUpTwin(MergedColumnParallelLinear):
    """The twin's."""


class Layer1GateUpWithLoRA(MergedColumnParallelLinearWithLoRA):
    def slice_lora_b(self, lora_b):
        # The bug under test: every rank takes rank 0's rows of B (the rank offset left out).
        return [None if b is None else b[:size, :] for b, size in zip(lora_b, self.output_slices)]

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None):
        return type(source_layer) is Layer1GateUp


class Layer1GateUpTwinWithLoRA(MergedColumnParallelLinearWithLoRA):
    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None):
        return type(source_layer) is Layer1GateUpTwin


vllm.lora.utils._all_lora_classes = (Layer1GateUpWithLoRA, Layer1GateUpTwinWithLoRA, *vllm.lora.utils._all_lora_classes)


def _layer(cls):
    class Layer(LlamaDecoderLayer):
        def __init__(self, vllm_config, prefix="", **kwargs):
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            if prefix.endswith(".layers.1"):
                self.mlp.gate_up_proj.__class__ = cls

    return Layer


class EctpLoraShardForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_layer(Layer1GateUp))


class EctpLoraShardTwinForCausalLM(LlamaForCausalLM):
    enginecheck_reference = "LlamaForCausalLM"

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_layer(Layer1GateUpTwin))
'''

# Issue 19 item 4, the quant check: planted bugs in the pre-quantized checkpoint's scales as the model loads them.
# quant_scale: layer 1's down_proj weight_scale 5 % too large at every TP size; quant_shard: at TP>1, layer 1's
# gate_proj weight_scale gives every rank rank 0's rows (rank 1 scales its output channels by rank 0's scales).
ENTRY_POINTS["quant_scale"] = "ectp.quant_bugs:register_scale"
ENTRY_POINTS["quant_shard"] = "ectp.quant_bugs:register_shard"
SOURCES["ectp/quant_bugs.py"] = '''\
def register_scale():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpQuantScaleForCausalLM", "ectp.models.quant_bugs:EctpQuantScaleForCausalLM")


def register_shard():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpQuantShardForCausalLM", "ectp.models.quant_bugs:EctpQuantShardForCausalLM")
'''
SOURCES["ectp/models/quant_bugs.py"] = _LLAMA + '''\
from vllm.distributed import get_tensor_model_parallel_world_size


def _scale_off(name, weight):
    if name == "model.layers.1.mlp.down_proj.weight_scale":
        return weight * 1.05
    return weight


def _rank0_scales(name, weight):
    tp = get_tensor_model_parallel_world_size()
    if name == "model.layers.1.mlp.gate_proj.weight_scale" and tp > 1:
        return weight[: weight.shape[0] // tp].repeat(tp, *([1] * (weight.dim() - 1)))
    return weight


class EctpQuantScaleForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights):
        return super().load_weights((name, _scale_off(name, w)) for name, w in weights)


class EctpQuantShardForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights):
        return super().load_weights((name, _rank0_scales(name, w)) for name, w in weights)
'''

# The expert oracle's planted bug: in a Mixtral, layer 1's expert 2's down projection weight_scale 5 % too large at
# every TP size (experts 0 and 1, layer 0 and every linear layer right).
ENTRY_POINTS["quant_expert"] = "ectp.quant_expert_bug:register"
SOURCES["ectp/quant_expert_bug.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpQuantExpertForCausalLM", "ectp.models.quant_expert:EctpQuantExpertForCausalLM")
'''
SOURCES["ectp/models/quant_expert.py"] = '''\
from vllm.model_executor.models.mixtral import MixtralForCausalLM


def _scale_off(name, weight):
    if name == "model.layers.1.block_sparse_moe.experts.2.w2.weight_scale":
        return weight * 1.05
    return weight


class EctpQuantExpertForCausalLM(MixtralForCausalLM):
    def load_weights(self, weights):
        return super().load_weights((name, _scale_off(name, w)) for name, w in weights)
'''

# Issue 31 item 2, an out-of-tree author's declarations: a Llama subclass whose logits are scaled by a config field
# LlamaConfig has not (read while it is built, so no checkpoint of Llama's config builds it). declared gives the field
# in enginecheck_config and its reference (transformers' Llama with the same scale, a class of the author's) in
# enginecheck_reference; undeclared gives neither: its engine checks skip saying what to declare.
ENTRY_POINTS["declared"] = "ectp.declared:register"
SOURCES["ectp/declared.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpDeclaredForCausalLM", "ectp.models.scaled_logits:EctpDeclaredForCausalLM")
    ModelRegistry.register_model("EctpUndeclaredForCausalLM", "ectp.models.scaled_logits:EctpUndeclaredForCausalLM")
'''
SOURCES["ectp/models/scaled_logits.py"] = _LLAMA + '''\
class EctpUndeclaredForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        self.logit_scale = config.ectp_logit_scale

    def compute_logits(self, *args, **kwargs):
        logits = super().compute_logits(*args, **kwargs)
        return None if logits is None else logits * self.logit_scale


class EctpDeclaredForCausalLM(EctpUndeclaredForCausalLM):
    enginecheck_config = {"ectp_logit_scale": 2.0}
    enginecheck_reference = "ectp.reference:ScaledLogitsLlama"
'''
SOURCES["ectp/reference.py"] = '''\
import transformers


class ScaledLogitsLlama(transformers.LlamaForCausalLM):
    """What EctpDeclaredForCausalLM computes, in transformers: Llama with its logits scaled by ectp_logit_scale."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * self.config.ectp_logit_scale
        return output
'''

# Issue 32 item 2 on vLLM: a Llama that starts a non-daemon thread at its first forward (it waits for ever: the rank's
# exit waits for it, until the shutdown grace ends and the rank is killed), and its twin whose thread is a daemon.
ENTRY_POINTS["threads"] = "ectp.threads:register"
SOURCES["ectp/threads.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpThreadForCausalLM", "ectp.models.threads:EctpThreadForCausalLM")
    ModelRegistry.register_model("EctpDaemonThreadForCausalLM", "ectp.models.threads:EctpDaemonThreadForCausalLM")
'''
SOURCES["ectp/models/threads.py"] = "import threading\n\n" + _LLAMA + '''\
def ectp_wait_forever(event):
    event.wait()


class EctpThreadForCausalLM(LlamaForCausalLM):
    daemon_thread = False

    def forward(self, *args, **kwargs):
        if not hasattr(self, "_ectp_thread"):
            self._ectp_thread = threading.Thread(target=ectp_wait_forever, args=(threading.Event(),),
                                                 name="ectp-stats", daemon=self.daemon_thread)
            self._ectp_thread.start()
        return super().forward(*args, **kwargs)


class EctpDaemonThreadForCausalLM(EctpThreadForCausalLM):
    daemon_thread = True
'''

# Issue 31 item 1 on vLLM, the determinism run: a Llama whose final hidden states get torch.randn noise (as a dropout
# left on would), the same at every TP size and under the engine's fixed seed, so only a second run under another
# seed shows it.
ENTRY_POINTS["noise"] = "ectp.noise:register"
SOURCES["ectp/noise.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpNoiseForCausalLM", "ectp.models.noise:EctpNoiseForCausalLM")
'''
SOURCES["ectp/models/noise.py"] = "import torch\n\n" + _LLAMA + '''\
class EctpNoiseForCausalLM(LlamaForCausalLM):
    enginecheck_reference = "LlamaForCausalLM"

    def forward(self, *args, **kwargs):
        hidden = super().forward(*args, **kwargs)
        return hidden + 0.5 * torch.randn_like(hidden)
'''

# Issue 32 item 1 on vLLM, budget over real work: a Llama that allocates a 256 MiB scratch in decode steps only (a step
# of at most max_num_seqs tokens; the profile run is one step of max_num_batched_tokens) and keeps it until the next,
# and one that keeps 4 MiB of every forward (a per-request leak). Their clean twin is EctpWorkspaceForCausalLM, whose
# workspace every step allocates and frees, the profile run's too.
ENTRY_POINTS["serving"] = "ectp.serving:register"
SOURCES["ectp/serving.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpDecodeScratchForCausalLM", "ectp.models.serving:EctpDecodeScratchForCausalLM")
    ModelRegistry.register_model("EctpRequestLeakForCausalLM", "ectp.models.serving:EctpRequestLeakForCausalLM")
'''
SOURCES["ectp/models/serving.py"] = "import torch\n\n" + _LLAMA + '''\
class EctpDecodeScratchForCausalLM(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        hidden = super().forward(*args, **kwargs)
        if hidden.shape[0] <= 4:  # a decode step: one token per running request
            self.ectp_scratch = torch.empty(64 * 2**20)  # 256 MiB, kept until the next decode step
        return hidden


class EctpRequestLeakForCausalLM(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        hidden = super().forward(*args, **kwargs)
        self.__dict__.setdefault("ectp_kept", []).append(torch.empty(2**20))  # 4 MiB per forward, never freed
        return hidden
'''

# Issue 31 item 4 on vLLM, tiny configs that keep what real configs of the family have: a bug for each variant that the
# old, uniform tiny config (heads * head_dim == hidden_size, no rope scaling, no sliding window) built the same as the
# correct code. EctpDerivedScaleForCausalLM: layer 1's attention scales its scores by (hidden_size // heads) ** -0.5,
# the head size of a config without head_dim, not the config's head_dim. EctpUnscaledRopeForCausalLM: layer 1's rotary
# embedding is built from rope_theta alone, the config's llama3 scaling dropped. Both declare transformers' Llama their
# reference; EctpRefTwinForCausalLM (reference_bug) is their clean twin. EctpNoWindowGemma2ForCausalLM: a Gemma 2
# whose attention ignores the config's sliding window (every layer built as full attention; the tiny Gemma 2's
# sliding-window layer is layer 0, as in every Gemma pattern), beside its clean twin EctpGemma2TwinForCausalLM; both
# declare transformers' Gemma2ForCausalLM their reference.
ENTRY_POINTS["config_bugs"] = "ectp.config_bugs:register"
SOURCES["ectp/config_bugs.py"] = '''\
def register():
    from vllm import ModelRegistry

    for name in ("EctpDerivedScaleForCausalLM", "EctpUnscaledRopeForCausalLM"):
        ModelRegistry.register_model(name, f"ectp.models.config_bugs:{name}")
    for name in ("EctpNoWindowGemma2ForCausalLM", "EctpGemma2TwinForCausalLM"):
        ModelRegistry.register_model(name, f"ectp.models.gemma2_window:{name}")
'''
SOURCES["ectp/models/config_bugs.py"] = _LLAMA + '''\
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer


class _DerivedScaleAttention(LlamaAttention):
    def __init__(self, *args, prefix="", **kwargs):
        super().__init__(*args, prefix=prefix, **kwargs)
        derived = self.hidden_size // self.total_num_heads
        # The bug under test: layer 1's softmax scale is derived ** -0.5 (the engine's attention applies
        # head_dim ** -0.5 to the queries scaled here by sqrt(head_dim / derived)).
        self.ectp_query_scale = (self.head_dim / derived) ** 0.5 if prefix.endswith(".layers.1.self_attn") else 1.0

    def forward(self, positions, hidden_states):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q * self.ectp_query_scale, k, v))
        return output


class _UnscaledRopeAttention(LlamaAttention):
    def __init__(self, *args, prefix="", **kwargs):
        super().__init__(*args, prefix=prefix, **kwargs)
        if prefix.endswith(".layers.1.self_attn"):
            # The bug under test: layer 1's rotary embedding from rope_theta alone, the config's scaling dropped.
            theta = kwargs["config"].rope_parameters["rope_theta"]
            self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                       rope_parameters={"rope_type": "default", "rope_theta": theta},
                                       is_neox_style=True)


class _DerivedScaleLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config, prefix="", config=None):
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config, attn_layer_type=_DerivedScaleAttention)


class _UnscaledRopeLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config, prefix="", config=None):
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config, attn_layer_type=_UnscaledRopeAttention)


class EctpDerivedScaleForCausalLM(LlamaForCausalLM):
    enginecheck_reference = "LlamaForCausalLM"

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_DerivedScaleLayer)


class EctpUnscaledRopeForCausalLM(LlamaForCausalLM):
    enginecheck_reference = "LlamaForCausalLM"

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_UnscaledRopeLayer)
'''
SOURCES["ectp/models/gemma2_window.py"] = '''\
from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM


class EctpNoWindowGemma2ForCausalLM(Gemma2ForCausalLM):
    enginecheck_reference = "Gemma2ForCausalLM"

    def __init__(self, *, vllm_config, prefix=""):
        config = vllm_config.model_config.hf_config
        kept = list(config.layer_types)
        config.layer_types = ["full_attention"] * len(kept)  # the bug under test: the sliding window ignored
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        finally:
            config.layer_types = kept


class EctpGemma2TwinForCausalLM(Gemma2ForCausalLM):
    enginecheck_reference = "Gemma2ForCausalLM"
'''

# Issue 32 item 3 on vLLM, the strict CUDA guard in every rank (--enginecheck-strict): a Llama whose layer 1 asks
# torch.cuda.is_available() in its forward (every step; on CPU it answers False, so nothing but the guard sees it), one
# whose layer 1 counts the GPUs while it is built, only at tensor_parallel_size > 1 (load[tp=1] builds it clean), and
# their clean twin, whose layer 1 takes its device from its own parameters in both places and asks vLLM's platform.
ENTRY_POINTS["strict_cuda"] = "ectp.strict_cuda:register"
SOURCES["ectp/strict_cuda.py"] = '''\
def register():
    from vllm import ModelRegistry

    for name in ("EctpForwardProbeForCausalLM", "EctpTpBuildProbeForCausalLM", "EctpDeviceTwinForCausalLM"):
        ModelRegistry.register_model(name, f"ectp.models.strict_cuda:{name}")
'''
SOURCES["ectp/models/strict_cuda.py"] = "import torch\n" + _LLAMA + '''\
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.platforms import current_platform


class _ForwardProbeLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config, prefix="", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.ectp_layer1 = prefix.endswith(".layers.1")

    def forward(self, positions, hidden_states, residual):
        if self.ectp_layer1 and torch.cuda.is_available():  # the bug under test: asks torch.cuda in forward
            hidden_states = hidden_states.cuda()
        return super().forward(positions, hidden_states, residual)


class _TpBuildProbeLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config, prefix="", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        if prefix.endswith(".layers.1") and get_tensor_model_parallel_world_size() > 1:
            self.ectp_gpus = torch.cuda.device_count()  # the bug under test: counts the GPUs while built, at TP>1


class _DeviceTwinLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config, prefix="", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.ectp_layer1 = prefix.endswith(".layers.1")
        if self.ectp_layer1 and get_tensor_model_parallel_world_size() > 1:
            self.ectp_device = self.mlp.down_proj.weight.device  # the device from its parameters, not torch.cuda
            self.ectp_fused = current_platform.is_cuda()  # vLLM's own platform answers

    def forward(self, positions, hidden_states, residual):
        if self.ectp_layer1 and self.mlp.down_proj.weight.device.type == "cuda":
            hidden_states = hidden_states.to(self.mlp.down_proj.weight.device)
        return super().forward(positions, hidden_states, residual)


class EctpForwardProbeForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_ForwardProbeLayer)


class EctpTpBuildProbeForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_TpBuildProbeLayer)


class EctpDeviceTwinForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_DeviceTwinLayer)
'''

# Issue 32 item 2 on vLLM, leftovers after every engine: a Llama that writes a file at a fixed path in the system temp
# dir while it is built, one that starts a helper process in a session of its own at its first decode step (so the
# rank's process group does not take it along), and the twin that keeps an anonymous temporary file open (gone with
# the rank).
ENTRY_POINTS["leftovers"] = "ectp.leftovers:register"
SOURCES["ectp/leftovers.py"] = '''\
def register():
    from vllm import ModelRegistry

    for name in ("EctpTempPathForCausalLM", "EctpHelperProcessForCausalLM", "EctpTempFileTwinForCausalLM"):
        ModelRegistry.register_model(name, f"ectp.models.leftovers:{name}")
'''
SOURCES["ectp/models/leftovers.py"] = "import subprocess\nimport tempfile\n\n" + _LLAMA + '''\
FIXED_PATH = "/tmp/ectp-fixed-path-stats.json"


class EctpTempPathForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        with open(FIXED_PATH, "w") as f:
            f.write("{}")


class EctpHelperProcessForCausalLM(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        hidden = super().forward(*args, **kwargs)
        if hidden.shape[0] <= 4 and not hasattr(self, "ectp_helper"):  # the first decode step
            self.ectp_helper = subprocess.Popen(["sleep", "613"], start_new_session=True)
        return hidden


class EctpTempFileTwinForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ectp_scratch_file = tempfile.TemporaryFile()  # no name: gone with the rank
'''

# vLLM's own layout (spawned engine core and workers) on a busy machine: a Llama whose process takes 5 s more to exit
# after vLLM's shutdown (an atexit handler: longer than vLLM's 5 s default grace, within the check's 10 s). Its exit
# is clean, so the engine must leave nothing: vLLM's SIGKILL after its own 5 s left the engine core's shared-memory
# queues in /dev/shm, a false alarm of the check (CI, KimiK25 in the spawned layout beside another engine).
ENTRY_POINTS["slow_exit"] = "ectp.slow_exit:register"
SOURCES["ectp/slow_exit.py"] = '''\
def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpSlowExitForCausalLM", "ectp.models.slow_exit:EctpSlowExitForCausalLM")
'''
SOURCES["ectp/models/slow_exit.py"] = "import atexit\nimport time\n\n" + _LLAMA + '''\
# At least 5 s after vLLM's SIGTERM to the engine core, which its default 5 s wait then cuts short: about 7 s here
# with the worker's own teardown, well inside the 10 s grace also when a neighbour's engine slows it down.
EXIT_S = 5.0


_slowed = []  # once per process, however many times vLLM builds the model in it


class EctpSlowExitForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if not _slowed:
            _slowed.append(atexit.register(time.sleep, EXIT_S))  # a clean exit that takes its time (flushing, joining)
'''
