"""The checks ``--enginecheck`` runs per architecture, each in its own warm child process.

A check is a function ``run(ctx: CheckContext) -> dict`` executed in the child: it returns the
result's ``detail`` when the architecture passes, raises CheckFailure with plain sentences (and
a detail dict) when it fails, or CheckSkip when the check does not apply. The child turns that
into the one CheckResult it sends back (``runner.run_in_child``); nothing else crosses over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from pytest_enginecheck.settings import Settings


@dataclass(frozen=True)
class CheckSpec:
    """One check: registration, item names, roots, the options' help and the README table derive from these.

    ``roots``: what a failure of it may repeat, of the same architecture: ``"import"`` (its module's import),
    ``"build"`` (the import and the inspection, then the build at TP=1, ``load[tp=1]``, and at its own TP size
    ``load[tp=N]``), or nothing. It is folded into the first of them that failed for the same cause (``checks.causes``).
    """

    name: str
    subject: str  # what the check was doing, as the start of a sentence (str.format over CheckContext's fields)
    proves: str  # the README table's sentence
    tp: bool = False  # one item per TP size (``load[tp=2]``)
    per_method: bool = False  # one item per quantization method and TP size (``quant[fp8,tp=2]``)
    roots: str = "import"  # "", "import" or "build"
    options: tuple[str, ...] = ()  # --enginecheck-* options it reads, a target's too (besides --enginecheck-timeout)

    def item_pattern(self) -> str:
        """The item's name as the README writes it: ``load[tp=N]``, ``quant[METHOD,tp=N]``."""
        return f"{self.name}[METHOD,tp=N]" if self.per_method else f"{self.name}[tp=N]" if self.tp else self.name


CHECK_SPECS = (
    CheckSpec("plugins", "Loading plugin {plugin!r} ({module})",
              roots="", options=("strict",),
              proves=("each installed general plugin (`enginecheck::plugin:<name>::plugins`) loads without CUDA and "
                      "without raising, in the warm parent and in a fresh interpreter (the engine's own process "
                      "state); one that raises while the target is described is a collection error instead, whatever "
                      "checks are selected")),
    CheckSpec("import", "Importing {module}",
              roots="", options=("strict",),
              proves=("importing the model's module does not initialize CUDA (with file, line and the import chain "
                      "when it does), and fails for what it is otherwise: a missing dependency, an exception, a "
                      "signal, an exit code, a hang")),
    CheckSpec("inspect", "Inspecting {architecture}",
              options=("inspect",),
              proves=("the engine's own registry can inspect the class in a subprocess")),
    CheckSpec("load", "Loading {architecture} at tensor_parallel_size={tp}",
              tp=True, roots="build", options=("tp", "strict"),
              proves=("it builds and loads on N real CPU ranks (gloo), every checkpoint tensor consumed (engine_ref's "
                      "loader); the prompts run as one batch of different lengths that cross KV block boundaries, "
                      "none a multiple of the block size, the longest ending at max_model_len; at TP=1 its "
                      "log-probabilities on each prompt "
                      "and its own generated tokens equal a reference implementation's on the same tiny checkpoint "
                      "(transformers' class of the architecture's own name, or the one its class declares in "
                      "`enginecheck_reference`; float32, within 1e-4), else the first position and the first module "
                      "where they part are named, and the summary says which architectures had no reference; on "
                      "engine_ref every parameter equals what the checkpoint holds for it and lm_head is tied as "
                      "config.json says, and decoding with the KV cache gives the tokens and log-probabilities "
                      "(within 1e-4) of recomputing without it; two TP=1 runs under different seeds agree "
                      "(tokens, and every module's output, the model's own and the logits in a hooked forward; on "
                      "vLLM the same engine generates again after reseeding torch: the same tokens, log-probabilities "
                      "within 1e-4), else "
                      "it is reported as nondeterministic, naming the first module whose output changes, and TP sizes "
                      "are not compared; TP=N generates what TP=1 does, with the same model output and logits in a "
                      "hooked prefill (within 1e-4 + 1e-3·|x|; on vLLM the same log-probabilities within 1e-4), else a "
                      "second TP=N run tells a TP-only nondeterminism from a TP bug, and the diagnosis names the first "
                      "module whose output differs and whether its weight shards or its "
                      "collective are wrong (a module it cannot compare is named as such, a diagnosis that fails "
                      'says so, and a sentence that is only a hint starts with "Hint")')),
    CheckSpec("budget", "Measuring the memory of {architecture} at tensor_parallel_size={tp}",
              tp=True, roots="build",
              options=("tp", "strict", "budget_memory", "budget_utilization", "budget_max_model_len", "device_memory"),
              proves=("per-rank weights + buffers + activation peak + KV cache fit the budget and equal the "
                      "meta-device estimate; also while serving requests (a batch of prompts of different lengths, "
                      "prefill then decode steps, then the same requests again): each rank's peak in prefill and in "
                      "decode steps fits the budget (a failure names the phase), and a rank holds no more after the "
                      "second round than after the first (a per-request leak, named with its size and rank). On vLLM, "
                      "where the budget holds one request's KV (its CPU KV cache is sized apart), a step's peak must "
                      "also stay within what vLLM's profile run measured (beyond 1/8 of it, at least 1 MiB): vLLM "
                      "reserves only that for activations and gives the rest of the GPU to the KV cache; with "
                      "`--enginecheck-device-memory`, the full-size model (engine_ref: its `reference_config`; vLLM: "
                      "`--enginecheck-full-size-configs` or `enginecheck_full_size_config`, predicted from vLLM's own "
                      "classes, docs/fit.md) fits too")),
    CheckSpec("startup", "Starting and stopping {architecture}",
              roots="build", options=("tp", "strict"),
              proves=("full engine startup, requests (prefill, then decode steps) and shutdown: every worker exits by "
                      "itself when asked (none needs SIGTERM or SIGKILL, none leaves a non-daemon thread running; a "
                      "failure names each thread with its target and stack), and nothing is left behind: no process "
                      "(named with its command line), fd, port, temp entry, shared memory, or entry its processes made "
                      "in /tmp or the working directory (fanotify names who made each, so another process's is never "
                      "blamed; where it cannot, the detail says what was not watched and why; a /dev/shm segment "
                      "another process held, or whose maker fanotify names outside the check's process tree, is "
                      "another program's). load, budget, lora and "
                      "quant hold every engine they start to the same. On vLLM, each start (its ranks, vLLM's start, "
                      "the requests, the shutdown) is watched the same way: a rank that had to be killed after the "
                      "10 s shutdown grace fails with its Python stacks, and a process left running is named, then "
                      "killed")),
    CheckSpec("lora", "Running {architecture} with a LoRA adapter at tensor_parallel_size={tp}",
              tp=True, roots="build", options=("tp", "strict"),
              proves=("with a tiny PEFT adapter at TP=N, greedy tokens equal TP=1's with the adapter and differ from "
                      "the base model's; at TP=1 the log-probabilities with the adapter and without it, teacher-forced "
                      "on the engine's tokens, equal those of the architecture's reference implementation (load's: "
                      "never a base class's) with the same adapter loaded by PEFT, within 1e-4, which catches a bug "
                      "that is the same at every TP size (on engine_ref the first module where they part is named, "
                      "and whether its LoRA layer ran; without a reference the result says it was held to itself "
                      "only); on vLLM (its own `enable_lora`/`LoRARequest` path) the generated tokens' "
                      "log-probabilities also equal TP=1's within 1e-4 (architectures declaring `SupportsLoRA`)")),
    CheckSpec("quant", "Running {architecture} quantized with {quantization} at tensor_parallel_size={tp}",
              tp=True, per_method=True, roots="build", options=("tp", "strict", "quant"),
              proves=("the exact oracle of a weight-only method (all of engine_ref's are: fp8, fbgemm_fp8 and int8 "
                      "dequantize the weight and run the unquantized matmul; no activation is quantized): the model "
                      "converted at startup at TP=1, and its pre-quantized tiny checkpoint at TP=N, produce the "
                      "logits of the unquantized engine loaded with the dequantized weights deq(W) at the same TP "
                      "size, within float rounding (`2·2(weights+1)·K·u`, 2.7e-4 of the largest logit for the tiny "
                      "Llama; a correct engine measures 0, a scale 1 % off in one weight about 5e-3); a failure "
                      "names the logit, the difference and the weight whose dequantized value is not deq(W). Then "
                      "TP=N generates what TP=1 does, the logits' error against the original weights is above 0 and "
                      "under the sum of the weights' relative errors (a loose sanity check, not a bound), and "
                      "estimate equals measurement (architectures declaring `SupportsQuant`). On vLLM (methods its "
                      "CPU backend runs: `int8`, compressed-tensors W8A8 with dynamic per-token int8 activations, "
                      "float32, or bfloat16 on a CPU with AMX, whose int8 kernel in vLLM takes nothing else; "
                      "`w4a16`, 4-bit weights in groups of 32, bfloat16; fp8 and fbgemm_fp8 are not "
                      "offered, the settings line says why), from a pre-quantized tiny checkpoint in "
                      "compressed-tensors' own layout with power-of-two scales: every quantized linear layer's own "
                      "product on every rank at TP=N, on inputs its activation quantization represents exactly, "
                      "equals bitwise that of the unquantized layer holding deq(W) on the dequantized twin at the "
                      "same TP size (every sum is exact, so the bound is one rounding into the dtype; a scale 5 % off "
                      "is named with its layer, rank and ratio 1.05); fused MoE experts it runs quantized (int8 with "
                      "AMX) get every expert on a fixed routing, each rank's output within a bound derived from the "
                      "scheme (the intermediate rounded into the dtype and quantized per token, each expert's output "
                      "and their sum rounded once) around the dequantized experts' on that rank's shard, computed "
                      "in float64 (a down projection scale 5 % off in one expert of layer 1 is named at TP 1 and 2); "
                      "MoE experts that vLLM's CPU backend cannot run quantized with the method skip with vLLM's "
                      "reason")),
)
SPECS = {spec.name: spec for spec in CHECK_SPECS}
CHECKS = tuple(SPECS)
TP_CHECKS = tuple(spec.name for spec in CHECK_SPECS if spec.tp)  # one item per TP size
BUILD_ROOT = "load[tp=1]"


@dataclass(frozen=True)
class CheckContext:
    """Everything a check needs, sent to its child process: what its item is, and the run's ``options``."""

    check: str
    spec: str
    architecture: str
    module: str
    class_name: str
    workdir: str  # where checkpoints are generated, shared by the session's checks
    tp: int = 1
    plugin: str = ""  # the plugins check: the entry point's name (``module`` is its module)
    quantization: str | None = None  # the quant check: the method (``--enginecheck-quant``)
    options: Settings = field(default_factory=Settings)  # the run's resolved options (``ctx.options.timeout``)
    required: bool = False  # --enginecheck-fail-on-skip selects its architecture: its skip is a failure
    # why the target does not offer the check here: an item of a required architecture made only to fail (a run that
    # asks for every check and selects architectures with --enginecheck-fail-on-skip must not drop it silently)
    refused: str = ""


def item_name(ctx: CheckContext) -> str:
    """The item's name and its result's ``check``: ``load[tp=2]`` for a TP check (``quant[fp8,tp=2]``), else the
    check."""
    spec = SPECS[ctx.check]
    if not spec.tp:
        return ctx.check
    method = f"{ctx.quantization}," if spec.per_method else ""
    return f"{ctx.check}[{method}tp={ctx.tp}]"


def subject(ctx: CheckContext) -> str:
    """What the check was doing, as the start of a sentence: ``Loading LlamaForCausalLM at tensor_parallel_size=2``."""
    return SPECS[ctx.check].subject.format(**{f.name: getattr(ctx, f.name) for f in fields(ctx)})


def roots(ctx: CheckContext) -> tuple[str, ...]:
    """The item names (of the same architecture) whose failure causes this item's, in the order to blame them."""
    spec, name = SPECS[ctx.check], item_name(ctx)
    found = ("import",) if spec.roots else ()
    if spec.roots != "build":
        return found
    found = (*found, "inspect")  # a class the registry cannot inspect is not built either (the same exception)
    if name == BUILD_ROOT:
        return found
    tp = ctx.tp if spec.tp else max(ctx.options.tp_sizes)  # startup runs at the largest TP size
    same_tp = f"load[tp={tp}]"  # a build that fails only at TP=N: load[tp=N] names the layer
    return (*found, BUILD_ROOT, *((same_tp,) if tp > 1 and same_tp != name else ()))


def markdown_table() -> str:
    """The README's table of checks, from CHECK_SPECS (``python -m pytest_enginecheck.checks`` prints it)."""
    rows = ["| check | what it proves |", "|---|---|"]
    rows += [f"| `{spec.item_pattern()}` | {spec.proves} |" for spec in CHECK_SPECS]
    return "\n".join(rows)


class CheckFailure(Exception):
    """The architecture failed the check (raised by the check in its child, and by its item); ``str(self)`` is
    what the user reads."""

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message, detail)
        self.message = message
        self.detail = detail or {}

    def __str__(self) -> str:
        return self.message


class CheckSkip(Exception):
    """The check does not apply to this architecture (the message says why)."""


@dataclass(frozen=True)
class CheckResult:
    """One item's outcome: what the child sends back, the item reports, the table and JSON show."""

    arch: str
    check: str  # the item name (see item_name)
    outcome: str  # "passed" | "failed" | "skipped"
    duration_s: float
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: "process" and "check", engine phases

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON object (the user property of the item and an entry of the JSON report)."""
        return {"arch": self.arch, "check": self.check, "outcome": self.outcome,
                "duration_s": round(self.duration_s, 4), "phases": {k: round(v, 4) for k, v in self.phases.items()},
                "message": self.message, "detail": self.detail}

    def longrepr(self, trim: Callable[[str], str] | None = None) -> str:
        """What a failure reads as: its sentences, then the child's traceback where one helps (through ``trim``:
        ``output.trimmed_traceback`` cuts it after the author's last frame)."""
        trace = self.detail.get("traceback")
        if not trace or self.detail.get("kind") == "cuda":
            return self.message
        return f"{self.message}\n\n{trim(trace) if trim else trace}"
