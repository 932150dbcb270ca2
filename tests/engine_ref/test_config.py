"""EngineArgs -> EngineConfig: every bad setting is refused with a message naming field, value and fix.

Model directories here hold only ``config.json`` (configuration never reads weights), written from
an architecture's own ``example_config``.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_ref.config import CacheConfig, EngineConfig
from engine_ref.engine.arg_utils import EngineArgs
from engine_ref.errors import ConfigError, MissingConfigField, UnknownArchitectureError
from engine_ref.model_executor.model_loader.checkpoint import example_config
from engine_ref.utils import parse_size
from tests.helpers import LLAMA

LLAVA = "LlavaForConditionalGeneration"
# The size units the engine documents, written out here as the test's own oracle.
SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "p": 1000**5, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
ONE_PIB = 1024**5  # the largest size the engine accepts


def write_model_dir(path: Path, architecture: str = LLAMA, overrides: dict[str, Any] | None = None,
                    drop: tuple[str, ...] = ()) -> Path:
    """A model directory with only config.json: the example config, updated, minus ``drop``."""
    config = example_config(architecture)
    config.update(overrides or {})
    for key in drop:
        del config[key]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def create_config(model: Path | str, **kwargs: Any) -> EngineConfig:
    return EngineArgs(model=str(model), **kwargs).create_engine_config()


@dataclass(frozen=True)
class BadConfig:
    """One refused configuration: what to write and pass, the error, and what its message must say.

    ``needles`` may contain ``{model}`` (the model directory). ``layout``: "ok" writes config.json,
    "no_dir" passes a directory that does not exist, "no_config" an empty directory.
    """

    kwargs: dict[str, Any] = field(default_factory=dict)
    needles: tuple[str, ...] = ()
    error: type[ConfigError] = ConfigError
    overrides: dict[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    config_text: str | None = None
    layout: str = "ok"


BAD_CONFIGS = {
    "tp-does-not-divide-heads": BadConfig(
        {"tensor_parallel_size": 3},
        ("tensor_parallel_size=3", "num_attention_heads=4", LLAMA, "use one of [1, 2, 4]")),
    "tp-does-not-divide-kv-heads": BadConfig(
        {"tensor_parallel_size": 3},
        ("tensor_parallel_size=3", "num_key_value_heads=4", "use one of [1, 2, 4, 12]"),
        overrides={"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 192}),
    "tp-zero": BadConfig({"tensor_parallel_size": 0}, ("tensor_parallel_size=0", "positive integer")),
    "gpu-memory-utilization-0": BadConfig(
        {"gpu_memory_utilization": 0}, ("gpu_memory_utilization=0 ", "(0, 1]", "e.g. 0.9")),
    "gpu-memory-utilization-1.5": BadConfig(
        {"gpu_memory_utilization": 1.5}, ("gpu_memory_utilization=1.5 ", "(0, 1]")),
    "gpu-memory-utilization-negative": BadConfig(
        {"gpu_memory_utilization": -1}, ("gpu_memory_utilization=-1 ", "(0, 1]")),
    "max-model-len-above-max-position-embeddings": BadConfig(
        {"max_model_len": 1024}, ("max_model_len=1024", "max_position_embeddings=512", "{model}", "at most 512")),
    "unknown-dtype": BadConfig({"dtype": "float8"}, ("dtype='float8'", "float32, float16, bfloat16")),
    "unsupported-dtype-in-config-json": BadConfig(
        {}, ("'float64'", "config.json", "float32, float16, bfloat16"), overrides={"torch_dtype": "float64"}),
    "model-dir-missing": BadConfig(
        {}, ("model='{model}'", "is not a directory", "engine-ref make-checkpoint"), layout="no_dir"),
    "dir-without-config-json": BadConfig({}, ("model='{model}'", "has no config.json"), layout="no_config"),
    "invalid-json": BadConfig(
        {}, ("{model}/config.json", "is not valid JSON", "regenerate config.json"), config_text='{"architectures": ['),
    "no-architectures": BadConfig(
        {}, ("{model}/config.json", "'architectures'", '"architectures": ["LlamaForCausalLM"]'),
        drop=("architectures",)),
    "unknown-architecture-near-match": BadConfig(
        {}, ("'LlamaForCausalLm'", "Did you mean LlamaForCausalLM", "register_model"),
        error=UnknownArchitectureError, overrides={"architectures": ["LlamaForCausalLm"]}),
    "unknown-architecture-no-match": BadConfig(
        {}, ("'GPT2LMHeadModel'", "Registered: ", LLAMA, "register_model"),
        error=UnknownArchitectureError, overrides={"architectures": ["GPT2LMHeadModel"]}),
    "device-memory-8-gigs": BadConfig({"device_memory": "8 gigs"}, ("device_memory='8 gigs'", "'8GiB'")),
    "device-memory-empty": BadConfig({"device_memory": ""}, ("device_memory=''", "'8GiB'")),
    "device-memory-negative": BadConfig({"device_memory": "-1GiB"}, ("device_memory='-1GiB'", "'8GiB'")),
    "device-memory-unit-only": BadConfig({"device_memory": "GiB"}, ("device_memory='GiB'", "'8GiB'")),
    "device-memory-zero-bytes": BadConfig({"device_memory": 0}, ("device_memory=0", "positive number of bytes")),
    "unknown-device": BadConfig({"device": "tpu"}, ("device='tpu'", "'cpu' or 'cuda'")),
    "unknown-load-format": BadConfig({"load_format": "gguf"}, ("load_format='gguf'", "safetensors, dummy, pt")),
    "unknown-executor-backend": BadConfig(
        {"distributed_executor_backend": "threads"}, ("distributed_executor_backend='threads'", "uni, mp, ray")),
    "uni-backend-with-tp-2": BadConfig(
        {"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
        ("distributed_executor_backend='uni'", "tensor_parallel_size=2", "use 'mp' or 'ray'")),
    "max-num-batched-tokens-below-max-model-len": BadConfig(
        {"max_num_batched_tokens": 100},
        ("max_num_batched_tokens=100", "max_model_len=512", "at least 512")),
    "block-size-zero": BadConfig({"block_size": 0}, ("block_size=0", "positive integer")),
    "missing-num-attention-heads": BadConfig(
        {}, ("{model}/config.json", "'num_attention_heads'", "add it to config.json"),
        error=MissingConfigField, drop=("num_attention_heads",)),
    "missing-vocab-size": BadConfig(
        {}, ("'vocab_size'", "add it to config.json"), error=MissingConfigField, drop=("vocab_size",)),
    "no-max-position-embeddings-and-no-max-model-len": BadConfig(
        {}, ("max_position_embeddings", "pass max_model_len"), drop=("max_position_embeddings",)),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS.values()), ids=list(BAD_CONFIGS))
def test_bad_config_is_refused_with_a_clear_message(case: BadConfig, tmp_path: Path) -> None:
    model = tmp_path / "model"
    if case.layout == "no_config":
        model.mkdir()
    elif case.layout == "ok":
        if case.config_text is not None:
            model.mkdir()
            (model / "config.json").write_text(case.config_text)
        else:
            write_model_dir(model, overrides=case.overrides, drop=case.drop)
    with pytest.raises(case.error) as info:
        create_config(model, **case.kwargs)
    message = str(info.value)
    for needle in case.needles:
        assert needle.format(model=model) in message, message


def test_missing_config_field_is_also_an_attribute_error(tmp_path: Path) -> None:
    """A model reading an absent field through HFConfig gets MissingConfigField, and getattr defaults work."""
    config = create_config(write_model_dir(tmp_path)).model_config.hf_config
    assert getattr(config, "no_such_field", 7) == 7
    with pytest.raises(MissingConfigField, match=r"'no_such_field'.*add it to config\.json"):
        _ = config.no_such_field


def test_two_spellings_of_one_field_are_refused(tmp_path: Path) -> None:
    """Qwen3-MoE's num_experts and num_local_experts are one field (transformers' attribute_map)."""
    model = write_model_dir(tmp_path / "model", "Qwen3MoeForCausalLM", overrides={"num_local_experts": 8})
    with pytest.raises(ConfigError) as info:
        create_config(model)
    message = str(info.value)
    assert all(needle in message for needle in (f"{model}/config.json", "num_experts=4", "num_local_experts=8",
                                                 "keep one")), message


# -- valid configurations and their defaults ------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("llama") / "model")


def test_tp1_defaults(llama_dir: Path) -> None:
    config = create_config(llama_dir)
    assert config.parallel_config.distributed_executor_backend == "uni"
    assert config.model_config.architecture == LLAMA
    assert config.model_config.max_model_len == 512  # the example config's max_position_embeddings
    assert config.model_config.dtype == "float32"
    assert config.scheduler_config.max_num_batched_tokens == 2048
    assert config.device_config.capacity_bytes == 4 * 1024**3
    assert config.model_info is not None and config.model_info.architecture == LLAMA


def test_tp2_defaults_to_the_multiprocess_executor(llama_dir: Path) -> None:
    config = create_config(llama_dir, tensor_parallel_size=2)
    assert config.parallel_config.distributed_executor_backend == "mp"
    assert config.parallel_config.world_size == 2


def test_max_model_len_defaults_to_max_position_embeddings(tmp_path: Path) -> None:
    config = create_config(write_model_dir(tmp_path, overrides={"max_position_embeddings": 300}))
    assert config.model_config.max_model_len == 300
    assert config.scheduler_config.max_num_batched_tokens == 2048


def test_explicit_settings_are_kept(llama_dir: Path) -> None:
    config = create_config(llama_dir, max_model_len=64, device_memory="64MiB", max_num_batched_tokens=64,
                           block_size=8, gpu_memory_utilization=1.0)
    assert config.model_config.max_model_len == 64
    assert config.scheduler_config.max_num_batched_tokens == 64
    assert config.device_config.capacity_bytes == 64 * 1024**2
    assert config.cache_config.block_size == 8
    assert config.cache_config.gpu_memory_utilization == 1.0


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ({"torch_dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "torch.float16"}, "float16"),
        ({"torch_dtype": "half"}, "float16"),
        ({"dtype": "float16"}, "float16"),  # transformers 5 writes "dtype"
        ({}, "float32"),
    ],
    ids=["torch_dtype", "torch-prefix", "alias", "dtype-key", "absent"],
)
def test_auto_dtype_resolves_from_config_json(written: dict[str, str], expected: str, tmp_path: Path) -> None:
    model = write_model_dir(tmp_path, overrides=written, drop=("torch_dtype",) if "torch_dtype" not in written else ())
    assert create_config(model).model_config.dtype == expected
    assert create_config(model, dtype="float32").model_config.dtype == "float32"  # an explicit dtype wins


def test_llava_text_config_is_the_language_model(tmp_path: Path) -> None:
    config = create_config(write_model_dir(tmp_path, LLAVA), tensor_parallel_size=2)
    assert config.model_config.architecture == LLAVA
    assert config.model_config.max_model_len == 512  # from text_config
    assert config.model_config.num_key_value_heads == 2


# -- properties ------------------------------------------------------------------------------------

_spaces = st.sampled_from(["", " ", "  "])


@settings(max_examples=200, deadline=None)
@given(count=st.integers(1, 10**18), unit=st.sampled_from(sorted(SIZE_UNITS)), upper=st.booleans(),
       before=_spaces, between=_spaces, after=_spaces)
def test_parse_size_round_trips_integers_in_every_unit(count: int, unit: str, upper: bool, before: str,
                                                      between: str, after: str) -> None:
    text = f"{before}{count}{between}{unit.upper() if upper else unit}{after}"
    size = count * SIZE_UNITS[unit]
    if size <= ONE_PIB:
        assert parse_size(text, "device_memory") == size
    else:
        with pytest.raises(ConfigError, match=rf"^device_memory={re.escape(repr(text))} is larger than any device "
                                              rf".*write at most '1PiB'"):
            parse_size(text, "device_memory")


@given(st.integers(1, 2**64))
def test_parse_size_keeps_byte_counts_up_to_one_pib(count: int) -> None:
    for value in (count, str(count)):
        if count <= ONE_PIB:
            assert parse_size(value) == count
        else:
            with pytest.raises(ConfigError, match="is larger than any device"):
                parse_size(value)


def test_parse_size_fractions() -> None:
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("0.5KiB") == 512


_not_a_unit = st.from_regex(r"[a-zA-Z]{1,6}", fullmatch=True).filter(lambda u: u.lower() not in SIZE_UNITS)
_unit = st.sampled_from(sorted(SIZE_UNITS))
GARBAGE_SIZES = st.one_of(
    st.builds(lambda n, u: f"{n}{u}", st.integers(1, 10**6), _not_a_unit),       # 8gigs, 3XB
    st.builds(lambda n, u: f"{n} {u}s", st.integers(1, 10**6), st.sampled_from(["gig", "meg", "byte"])),
    st.builds(lambda n, u: f"-{n}{u}", st.integers(0, 10**6), _unit),           # negative
    st.builds(lambda u: f"0{u}", _unit),                                          # zero
    st.builds(lambda n, m, u: f"{n} {m}{u}", st.integers(0, 99), st.integers(0, 99), _unit),  # two numbers
    st.builds(lambda n, u: f"{n}{u}", st.sampled_from(["1e3", "1,5", ".5", "1.", "0x10", "1_000", "inf", "nan"]),
              _unit),
    _unit.map(str.upper),                                                         # a unit without a number
    st.from_regex(r"\s*", fullmatch=True),                                        # empty
)


@given(GARBAGE_SIZES)
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text, "device_memory")
    assert f"device_memory={text!r}" in str(info.value)


@given(st.one_of(st.text(max_size=12), st.integers(-(2**40), 0), st.booleans()))
def test_parse_size_returns_a_positive_size_or_raises_config_error(value: str | int | bool) -> None:
    """No input makes parse_size raise anything but ConfigError, or return a non-positive size."""
    try:
        size = parse_size(value, "device_memory")
    except ConfigError as e:
        assert "device_memory=" in str(e)
    else:
        assert isinstance(size, int) and size > 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def head_counts(draw: st.DrawFn) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads that divides it, tensor_parallel_size)."""
    heads = draw(st.integers(1, 24))
    kv_heads = draw(st.sampled_from(_divisors(heads)))
    tp = draw(st.one_of(st.sampled_from(_divisors(heads)), st.integers(1, 32)))  # half of them plausible
    return heads, kv_heads, tp


MLP_SPLITS_ANY_TP = 2**5 * 3**3 * 5**2 * 7 * 11 * 13 * 17 * 19 * 23 * 29 * 31  # divisible by 1..32


def _expect_valid(heads: int, kv_heads: int, tp: int) -> bool:
    return heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head_counts())
def test_tp_validation_passes_iff_tp_splits_the_heads(counts: tuple[int, int, int]) -> None:
    heads, kv_heads, tp = counts
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(Path(tmp), overrides={  # an MLP width every TP size up to 32 splits
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_size": 8 * heads,
            "intermediate_size": MLP_SPLITS_ANY_TP,
        })
        if _expect_valid(heads, kv_heads, tp):
            assert create_config(model, tensor_parallel_size=tp).parallel_config.world_size == tp
        else:
            with pytest.raises(ConfigError, match=rf"tensor_parallel_size={tp} does not divide") as info:
                create_config(model, tensor_parallel_size=tp)
            suggested = json.loads(re.search(r"use one of (\[.*\])", str(info.value)).group(1))
            assert suggested and all(_expect_valid(heads, kv_heads, t) for t in suggested)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head_counts(), st.sampled_from([1, 2, 3, 4, 6, 8]))
def test_tp_validation_includes_llava_vision_heads(counts: tuple[int, int, int], vision_heads: int) -> None:
    heads, kv_heads, tp = counts
    overrides = example_config(LLAVA)
    overrides["text_config"].update(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=8 * heads,
                                    intermediate_size=MLP_SPLITS_ANY_TP)
    overrides["vision_config"].update(num_attention_heads=vision_heads, hidden_size=8 * vision_heads,
                                      intermediate_size=MLP_SPLITS_ANY_TP)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(Path(tmp), LLAVA, overrides=overrides)
        if _expect_valid(heads, kv_heads, tp) and vision_heads % tp == 0:
            assert create_config(model, tensor_parallel_size=tp).parallel_config.world_size == tp
        else:
            with pytest.raises(ConfigError, match=rf"tensor_parallel_size={tp} does not divide") as info:
                create_config(model, tensor_parallel_size=tp)
            if vision_heads % tp:
                assert f"vision_config.num_attention_heads={vision_heads}" in str(info.value)


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.fractions().map(float)))
def test_gpu_memory_utilization_valid_iff_in_unit_interval(value: float) -> None:
    if 0 < value <= 1:
        assert CacheConfig(gpu_memory_utilization=value).gpu_memory_utilization == value
    else:
        with pytest.raises(ConfigError, match=re.escape(f"gpu_memory_utilization={value!r} must be in (0, 1]")):
            CacheConfig(gpu_memory_utilization=value)


# -- malformed config.json files, absurd sizes and environment variables ----------------------------

CONFIG_FILES = {
    # name: (config.json bytes, what the message must say besides the file's path)
    "json-list": (b'["LlamaForCausalLM"]', "holds a JSON list, not an object"),
    "json-string": (b'"LlamaForCausalLM"', "holds a JSON str, not an object"),
    "binary": (bytes(range(256)) * 4, "not UTF-8 text"),
    "nested-100000-deep": (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 32 levels"),
    "nested-33-deep": (b'{"architectures": ["LlamaForCausalLM"], "x": ' + b"[" * 33 + b"]" * 33 + b"}",
                       "nested deeper than 32 levels"),
    "17-MiB": (b'{"architectures": ["LlamaForCausalLM"]' + b" " * (17 * 1024**2) + b"}",
               f"larger than {16 * 1024**2} bytes"),
}


@pytest.mark.parametrize("name", list(CONFIG_FILES))
def test_malformed_config_json_is_a_config_error_naming_the_file(name: str, tmp_path: Path) -> None:
    content, needle = CONFIG_FILES[name]
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError) as info:
        create_config(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path}/config.json ") and needle in message, message
    assert "regenerate config.json" in message or "JSON object" in message, message


@pytest.mark.parametrize("value", [10**12, 1e12, 2**24 + 1, 0, "4096", True])
def test_max_position_embeddings_out_of_bounds_names_the_file(value: Any, tmp_path: Path) -> None:
    model = write_model_dir(tmp_path, overrides={"max_position_embeddings": value})
    with pytest.raises(ConfigError) as info:
        create_config(model)
    assert str(info.value).startswith(f"{model}/config.json: max_position_embeddings={value!r} "), info.value


def test_max_position_embeddings_at_the_limit_is_accepted(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path, overrides={"max_position_embeddings": 2**24})
    assert create_config(model, max_model_len=64).model_config.max_model_len == 64


@pytest.mark.parametrize("field", ["max_model_len", "max_num_batched_tokens"])
def test_token_counts_above_the_limit_are_refused(field: str, tmp_path: Path) -> None:
    model = write_model_dir(tmp_path, overrides={"max_position_embeddings": 2**24})
    with pytest.raises(ConfigError, match=rf"^{field}={2**24 + 1} is larger than engine_ref supports "
                                          rf"\(at most {2**24}\)"):
        create_config(model, **{field: 2**24 + 1})


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-inf", "-1", "0", "1e999"])
def test_ready_timeout_env_var_is_validated(value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_REF_READY_TIMEOUT_S", value)
    with pytest.raises(ConfigError, match=rf"^ENGINE_REF_READY_TIMEOUT_S={re.escape(repr(value))} is not a number "
                                          rf"of seconds"):
        create_config(write_model_dir(tmp_path))


def test_ready_timeout_env_var_sets_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_REF_READY_TIMEOUT_S", " 12.5 ")
    assert create_config(write_model_dir(tmp_path)).parallel_config.ready_timeout_s == 12.5
    monkeypatch.setenv("ENGINE_REF_READY_TIMEOUT_S", "")
    assert create_config(write_model_dir(tmp_path)).parallel_config.ready_timeout_s == 300.0


def test_worker_multiproc_method_env_var_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_ref import envs

    monkeypatch.setenv("ENGINE_REF_WORKER_MULTIPROC_METHOD", "threads")
    with pytest.raises(ConfigError, match=r"^ENGINE_REF_WORKER_MULTIPROC_METHOD='threads' is unknown; use one of "
                                          r"forkserver, spawn, fork"):
        envs.worker_multiproc_method()
    monkeypatch.setenv("ENGINE_REF_WORKER_MULTIPROC_METHOD", "spawn")
    assert envs.worker_multiproc_method() == "spawn"


# The tiny Llama: vocab 256 x hidden 64 in float32, 2 layers of 2 KV heads of 16: 512 KV bytes per token.
DEVICE_NEEDS = {
    # name: (config.json overrides, engine arguments, the start of the message, the field a fix names)
    "embedding": ({"vocab_size": 2**22}, {"device_memory": "64MiB", "max_model_len": 64},
                  "config.json's vocab_size=4194304 x hidden_size=64 (the embedding, on 1 rank(s)) needs 1.00 GiB",
                  "raise tensor_parallel_size"),
    "profile-batch": ({}, {"device_memory": "64MiB", "max_model_len": 64, "max_num_batched_tokens": 2**20},
                      "max_num_batched_tokens=1048576 (the profile run's batch) x hidden_size=64 needs 256.00 MiB",
                      "lower max_num_batched_tokens"),
    "one-request-kv": ({"max_position_embeddings": 2**21}, {"device_memory": "1GiB"},
                       "max_model_len=2097152 (one request's KV cache) needs 1.00 GiB", "max_model_len"),
    "block-count": ({}, {"device_memory": "64MiB", "max_model_len": 64, "num_gpu_blocks_override": 10**9},
                    "num_gpu_blocks_override=1000000000 (KV blocks) needs 7629.39 GiB", "num_gpu_blocks_override"),
}


@pytest.mark.parametrize("name", list(DEVICE_NEEDS))
def test_sizes_that_cannot_fit_the_device_are_refused_before_any_worker(name: str, tmp_path: Path) -> None:
    overrides, kwargs, start, fix_field = DEVICE_NEEDS[name]
    config = create_config(write_model_dir(tmp_path, overrides=overrides), **kwargs)
    with pytest.raises(ConfigError) as info:
        config.verify_device_memory()
    message = str(info.value)
    assert message.startswith(start), message
    assert "per rank, more than the 0.9 x " in message and message.endswith("or raise device_memory."), message
    bound = re.search(rf"lower {fix_field} to at most (\d+)", message)
    if bound:  # the suggested value passes the same check
        fixed = {**kwargs, fix_field: int(bound.group(1))}
        create_config(write_model_dir(tmp_path, overrides=overrides), **fixed).verify_device_memory()
    else:
        assert fix_field in message


def test_simulated_cpu_memory_must_exist_in_the_host(tmp_path: Path) -> None:
    config = create_config(write_model_dir(tmp_path), device_memory="1PiB")
    with pytest.raises(ConfigError, match=r"^device_memory='1PiB' \(1048576\.00 GiB\) exceeds this host's memory "
                                          r"\([\d.]+ GiB\), which holds the simulated CPU device; lower device_memory"):
        config.verify_device_memory()
    create_config(write_model_dir(tmp_path), device_memory="64MiB").verify_device_memory()
