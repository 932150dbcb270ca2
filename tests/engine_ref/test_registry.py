"""ModelRegistry: lazy listing, inspection in a warm child, the JSON ModelInfo cache and its failures.

Every test gets its own cache root (ENGINE_REF_CACHE_ROOT) and a fresh ``_ModelRegistry`` built
from the bundled entries, so neither the in-memory nor the on-disk cache carries over between tests.
Out-of-tree models are real modules written into a directory on ``sys.path``; the forkserver children
that inspect them receive ``sys.path`` with multiprocessing's preparation data and the environment
through engine_ref.isolation.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_ref.errors import ModelInspectionError, UnknownArchitectureError
from engine_ref.model_executor.models.interfaces import ModelInfo
from engine_ref.model_executor.models.registry import (
    MODEL_INFO_FORMAT_VERSION,
    ModelRegistry,
    RegisteredModel,
    _ModelRegistry,
)
from tests.helpers import ARCHITECTURES, TINY_MODEL_CLASS


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private, empty ModelInfo cache root for this test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("ENGINE_REF_CACHE_ROOT", str(root))
    return root


@pytest.fixture
def registry(cache_root: Path) -> _ModelRegistry:
    """A registry with the bundled entries and an empty in-memory cache."""
    return new_registry()


def new_registry() -> _ModelRegistry:
    """The bundled entries, nothing inspected yet."""
    return _ModelRegistry({arch: ModelRegistry.models[arch] for arch in ARCHITECTURES})


def new_registry_with(registry: _ModelRegistry) -> _ModelRegistry:
    """The same entries as ``registry``, nothing inspected yet."""
    return _ModelRegistry(registry.models)


@pytest.fixture
def oot_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path for out-of-tree model modules (children get sys.path too)."""
    src = tmp_path / "oot_models"
    src.mkdir()
    monkeypatch.syspath_prepend(str(src))
    return src


@pytest.fixture
def write_module(oot_dir: Path) -> Callable[[str, str], str]:
    """``write_module(source, kind) -> module name``: a uniquely named module in ``oot_dir``."""

    def write(source: str, kind: str = "model") -> str:
        name = f"oot_{kind}_{uuid.uuid4().hex[:8]}"
        (oot_dir / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        return name

    return write


def module_file(module_name: str) -> Path:
    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin
    return Path(spec.origin)


def cache_files(root: Path) -> list[Path]:
    return sorted((root / "modelinfos").glob("*.json"))


# -- listing and registering import nothing --------------------------------------------------------

def test_listing_and_register_model_import_nothing() -> None:
    """In a fresh interpreter: no torch and no model module after listing and registering."""
    script = textwrap.dedent("""
        import json, sys
        from engine_ref.model_executor.models.registry import ModelRegistry
        import engine_ref.model_executor.models
        archs = ModelRegistry.get_supported_archs()
        ModelRegistry.register_model("OutOfTreeForCausalLM", "not_a_real_package.models:OutOfTree")
        archs_after = ModelRegistry.get_supported_archs()
        print(json.dumps({
            "archs": archs, "archs_after": archs_after,
            "modules": sorted(m for m in sys.modules
                              if m == "torch" or m.startswith(("torch.", "not_a_real_package",
                                                               "engine_ref.model_executor.models."))),
        }))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["archs"] == ARCHITECTURES
    assert result["archs_after"] == [*ARCHITECTURES, "OutOfTreeForCausalLM"]
    # Only the registry machinery itself may be loaded: no torch, no model module.
    assert set(result["modules"]) <= {"engine_ref.model_executor.models.interfaces",
                                      "engine_ref.model_executor.models.registry"}, result["modules"]


def test_register_model_spec_is_validated_and_lazy(registry: _ModelRegistry) -> None:
    registry.register_model("LazyModel", "surely_absent_pkg.sub:LazyModel")
    assert registry.models["LazyModel"] == RegisteredModel("surely_absent_pkg.sub", "LazyModel")
    assert "surely_absent_pkg" not in sys.modules
    with pytest.raises(ValueError, match=r"package\.module:ClassName"):
        registry.register_model("Bad", "no_colon_here")


# -- subprocess once, then the JSON cache ----------------------------------------------------------

def test_first_inspection_uses_a_subprocess_then_the_json_cache(registry: _ModelRegistry, cache_root: Path) -> None:
    info = registry.inspect_model_cls("LlamaForCausalLM")
    assert registry.subprocess_inspections == 1
    assert info.architecture == "LlamaForCausalLM"
    assert info.module == "engine_ref.model_executor.models.llama"

    [path] = cache_files(cache_root)
    assert path.parent == cache_root / "modelinfos"
    data = json.loads(path.read_text())
    assert data["format_version"] == MODEL_INFO_FORMAT_VERSION
    assert data["source_hash"] == registry.models["LlamaForCausalLM"].source_hash()
    assert data["model_info"] == info.to_dict()

    assert registry.inspect_model_cls("LlamaForCausalLM") == info  # in memory
    assert registry.subprocess_inspections == 1

    second = new_registry()
    assert second.inspect_model_cls("LlamaForCausalLM") == info
    assert second.subprocess_inspections == 0  # served from the JSON file


def test_class_registration_is_inspected_in_process(registry: _ModelRegistry, cache_root: Path) -> None:
    class InProcessModel:
        def forward(self) -> None: ...
        def load_weights(self, weights: object) -> set[str]: return set()

    registry.register_model("InProcessModel", InProcessModel)
    info = registry.inspect_model_cls("InProcessModel")
    assert (info.class_name, info.is_text_generation_model) == (InProcessModel.__qualname__, False)
    assert registry.subprocess_inspections == 0
    assert cache_files(cache_root) == []


# -- editing the source invalidates the cache ------------------------------------------------------

def test_editing_the_model_source_invalidates_the_cache(registry: _ModelRegistry,
                                                        write_module: Callable[[str, str], str]) -> None:
    module = write_module(TINY_MODEL_CLASS)
    registry.register_model("TinyModel", f"{module}:TinyModel")
    before = registry.inspect_model_cls("TinyModel")
    assert registry.subprocess_inspections == 1
    assert new_registry_with(registry).inspect_model_cls("TinyModel") == before  # cached on disk

    path = module_file(module)
    path.write_text(path.read_text() + "# a comment changes the source hash\n")
    assert registry.inspect_model_cls("TinyModel") == before
    assert registry.subprocess_inspections == 2  # neither memory nor disk served the stale entry

    # The new inspection really sees the new source.
    path.write_text(path.read_text() + "TinyModel.is_moe = True\n")
    fresh = new_registry_with(registry)
    after = fresh.inspect_model_cls("TinyModel")
    assert fresh.subprocess_inspections == 1
    assert (before.is_moe, after.is_moe) == (False, True)


# -- a corrupt cache file is survived --------------------------------------------------------------

def _garbage(text: str) -> bytes:
    return b"\x89\xff\x00not json at all\xfe"


def _truncated(text: str) -> bytes:
    return text[: len(text) // 2].encode()


def _edit(change: Callable[[dict], object]) -> Callable[[str], bytes]:
    def corrupt(text: str) -> bytes:
        data = json.loads(text)
        data = change(data) or data
        return json.dumps(data).encode()
    return corrupt


CORRUPTIONS = {
    "garbage": _garbage,
    "empty": lambda text: b"",
    "truncated": _truncated,
    "json-list": lambda text: b"[1, 2, 3]",
    "wrong-format-version": _edit(lambda d: d.update(format_version=MODEL_INFO_FORMAT_VERSION + 1)),
    "no-model-info": _edit(lambda d: d.pop("model_info")),
    "unknown-field": _edit(lambda d: d["model_info"].update(supports_flying=True)),
    "another-architecture": _edit(lambda d: d["model_info"].update(architecture="Qwen2ForCausalLM",
                                                                    module="engine_ref.model_executor.models.qwen2",
                                                                    class_name="Qwen2ForCausalLM")),
    # Crafted entries with the right source hash: what workers would import, and wrong types.
    "os-getcwd": _edit(lambda d: d["model_info"].update(module="os", class_name="getcwd")),
    "another-class-same-module": _edit(lambda d: d["model_info"].update(class_name="LlamaModel")),
    "bool-as-string": _edit(lambda d: d["model_info"].update(supports_tp="false")),
    "bool-as-int": _edit(lambda d: d["model_info"].update(is_moe=1)),
    "architecture-as-list": _edit(lambda d: d["model_info"].update(architecture=["LlamaForCausalLM"])),
    "format-version-as-string": _edit(lambda d: d.update(format_version=str(MODEL_INFO_FORMAT_VERSION))),
    "format-version-as-bool": _edit(lambda d: d.update(format_version=True)),
    "source-hash-as-list": _edit(lambda d: d.update(source_hash=[d["source_hash"]])),
    "extra-top-level-key": _edit(lambda d: d.update(model_cls="os:system")),
    "nested-field": _edit(lambda d: d["model_info"].update(supports_tp={"a": {"b": True}})),
    "nested-100000-deep": lambda text: b"[" * 100_000 + b"]" * 100_000,
    "nested-100000-deep-object": lambda text: b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "huge": lambda text: text.encode() + b" " * (64 * 1024),
}
STALE = {"wrong-format-version"}  # well-formed but written for another format: replaced without a warning


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_cache_file_is_ignored_and_rewritten(corruption: str, registry: _ModelRegistry,
                                                     cache_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    info = registry.inspect_model_cls("LlamaForCausalLM")
    [path] = cache_files(cache_root)
    valid = path.read_text()
    path.write_bytes(CORRUPTIONS[corruption](valid))

    survivor = new_registry()
    with caplog.at_level("WARNING", logger="engine_ref.model_executor.models.registry"):
        assert survivor.inspect_model_cls("LlamaForCausalLM") == info
    assert survivor.subprocess_inspections == 1
    assert json.loads(path.read_text()) == json.loads(valid)  # rewritten valid
    warnings = [r.getMessage() for r in caplog.records if "model info cache" in r.getMessage()]
    if corruption in STALE:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(f"corrupt model info cache {path} ("), warnings
        assert warnings[0].endswith("inspecting LlamaForCausalLM again and rewriting it"), warnings

    reader = new_registry()
    assert reader.inspect_model_cls("LlamaForCausalLM") == info
    assert reader.subprocess_inspections == 0


def test_a_crafted_entry_never_reaches_the_workers(registry: _ModelRegistry, cache_root: Path,
                                                   tiny_checkpoint: Callable[..., Path]) -> None:
    """An entry naming ``os:getcwd`` with the right hash: the engine config still names Llama's class."""
    from engine_ref.engine.arg_utils import EngineArgs
    from engine_ref.model_executor.model_loader.loaders import get_model_cls

    registry.inspect_model_cls("LlamaForCausalLM")
    [path] = cache_files(cache_root)
    path.write_bytes(CORRUPTIONS["os-getcwd"](path.read_text()))

    config = EngineArgs(str(tiny_checkpoint("LlamaForCausalLM"))).create_engine_config(new_registry())
    assert config.model_info is not None
    assert (config.model_info.module, config.model_info.class_name) == (
        "engine_ref.model_executor.models.llama", "LlamaForCausalLM")
    assert get_model_cls(config) is registry.resolve_model_cls("LlamaForCausalLM")
    assert json.loads(path.read_text())["model_info"]["module"] == "engine_ref.model_executor.models.llama"


def test_a_reexported_class_is_cached_under_its_registered_module(registry: _ModelRegistry, cache_root: Path,
                                                                  write_module: Callable[[str, str], str]) -> None:
    """``pkg:Model`` where Model is defined in another module: the entry names what was registered."""
    impl = write_module(TINY_MODEL_CLASS, "impl")
    facade = write_module(f"from {impl} import TinyModel\n", "facade")
    registry.register_model("TinyModel", f"{facade}:TinyModel")
    info = registry.inspect_model_cls("TinyModel")
    assert (info.module, info.class_name) == (facade, "TinyModel")
    reader = new_registry_with(registry)
    assert reader.inspect_model_cls("TinyModel") == info
    assert reader.subprocess_inspections == 0  # the entry is valid, not re-inspected on every start


# -- a failing child surfaces its own error --------------------------------------------------------

FAILURES = {
    # kind: (module source, class name, texts the error must carry; {file} is the module's file name)
    "raises-at-import": ("raise RuntimeError('model module exploded: 7731')\n", "TinyModel",
                         ["RuntimeError: model module exploded: 7731", "Traceback (most recent call last)",
                          "{file}"]),
    "class-missing": (TINY_MODEL_CLASS, "MissingModel", ["has no class 'MissingModel'", "{module}"]),
    "missing-dependency": ("import surely_not_installed_dep_4412\n" + TINY_MODEL_CLASS, "TinyModel",
                           ["No module named 'surely_not_installed_dep_4412'", "{file}"]),
    "exits-at-import": ("import os\nos._exit(3)\n", "TinyModel", ["exited with code 3"]),
    "sys-exit-at-import": ("import sys\nsys.exit(5)\n", "TinyModel", ["SystemExit: 5", "{file}"]),
    # An exception class the parent could not rebuild (its __init__ takes two arguments).
    "custom-exception": ("class RopeProblem(Exception):\n"
                         "    def __init__(self, field, hint):\n"
                         "        super().__init__(f'{field}: {hint}')\n"
                         "raise RopeProblem('rope_scaling', 'type 7731 is unsupported')\n", "TinyModel",
                         ["RopeProblem: rope_scaling: type 7731 is unsupported", "{file}"]),
    "not-a-model-class": ("class TinyModel:\n    pass\n", "TinyModel",
                          ["is not a model class", "{module}.TinyModel", "load_weights"]),
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_failed_inspection_names_the_architecture_and_carries_the_childs_error(
        kind: str, registry: _ModelRegistry, cache_root: Path, write_module: Callable[[str, str], str]) -> None:
    source, class_name, expected = FAILURES[kind]
    module = write_module(source, kind.replace("-", "_"))
    registry.register_model("BrokenForCausalLM", f"{module}:{class_name}")

    with pytest.raises(ModelInspectionError) as excinfo:
        registry.inspect_model_cls("BrokenForCausalLM")
    message = str(excinfo.value)
    assert "'BrokenForCausalLM'" in message
    for text in expected:
        assert text.format(file=f"{module}.py", module=module) in message
    assert registry.subprocess_inspections == 1
    assert cache_files(cache_root) == []  # failures are not cached...

    with pytest.raises(ModelInspectionError):
        registry.inspect_model_cls("BrokenForCausalLM")
    assert registry.subprocess_inspections == 2  # ...so a fixed module is picked up at once


def test_package_init_never_runs_in_the_asking_process(registry: _ModelRegistry, oot_dir: Path) -> None:
    """The source hash locates ``pkg.model`` without importing ``pkg`` here; the child reports its errors."""
    good, bad = (f"oot_pkg_{kind}_{uuid.uuid4().hex[:8]}" for kind in ("good", "bad"))
    for package, init in ((good, "import os\nos.environ['OOT_PKG_INIT_RAN'] = '1'\n"),
                          (bad, "raise RuntimeError('plugin package __init__ failed: 5521')\n")):
        (oot_dir / package).mkdir()
        (oot_dir / package / "__init__.py").write_text(init)
        (oot_dir / package / "model.py").write_text(TINY_MODEL_CLASS)
    importlib.invalidate_caches()
    registry.register_model("GoodPkgModel", f"{good}.model:TinyModel")
    registry.register_model("BadPkgModel", f"{bad}.model:TinyModel")

    assert registry.inspect_model_cls("GoodPkgModel").module == f"{good}.model"
    with pytest.raises(ModelInspectionError, match="plugin package __init__ failed: 5521") as excinfo:
        registry.inspect_model_cls("BadPkgModel")
    assert "'BadPkgModel'" in str(excinfo.value) and f"{bad}/__init__.py" in str(excinfo.value)
    assert not {good, bad} & set(sys.modules)
    assert "OOT_PKG_INIT_RAN" not in os.environ
    # The source was found (and hashed) all the same: a second registry is served from the cache.
    second = new_registry_with(registry)
    assert second.inspect_model_cls("GoodPkgModel").module == f"{good}.model"
    assert second.subprocess_inspections == 0


def test_hanging_inspection_times_out_with_the_childs_stack(registry: _ModelRegistry,
                                                            write_module: Callable[[str, str], str]) -> None:
    module = write_module("import time\ntime.sleep(600)\n" + TINY_MODEL_CLASS, "hangs")
    registry.register_model("HangingForCausalLM", f"{module}:TinyModel")
    start = time.monotonic()
    with pytest.raises(ModelInspectionError) as excinfo:
        registry.inspect_model_cls("HangingForCausalLM", timeout=4.0)
    assert time.monotonic() - start < 60
    message = str(excinfo.value)
    assert "'HangingForCausalLM'" in message and "did not finish within 4 s" in message
    assert f"{module}.py" in message  # the faulthandler stack of the child, at its sleep


# -- inspect_all -----------------------------------------------------------------------------------

BARRIER_MODEL = '''
import os, time
BARRIER, PARTIES = @BARRIER@, @PARTIES@
open(os.path.join(BARRIER, __name__), "w").close()
deadline = time.monotonic() + 30
while len(os.listdir(BARRIER)) < PARTIES:
    if time.monotonic() > deadline:
        raise TimeoutError(f"only {len(os.listdir(BARRIER))} of {PARTIES} inspections ran at the same time")
    time.sleep(0.01)
''' + TINY_MODEL_CLASS


def test_inspect_all_runs_in_parallel_and_reports_each_failure(registry: _ModelRegistry, tmp_path: Path,
                                                               write_module: Callable[[str, str], str]) -> None:
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    parties = 3
    together = [f"Together{i}ForCausalLM" for i in range(parties)]
    source = BARRIER_MODEL.replace("@BARRIER@", repr(str(barrier))).replace("@PARTIES@", str(parties))
    for arch in together:  # each import waits until all of them are being inspected at once
        registry.register_model(arch, f"{write_module(source, 'barrier')}:TinyModel")
    registry.register_model("CrashesForCausalLM", f"{write_module('import os; os._exit(3)', 'crash')}:TinyModel")
    registry.register_model("RaisesForCausalLM", f"{write_module('raise ValueError(42)', 'raise')}:TinyModel")
    registry.register_model("ExitsForCausalLM", f"{write_module('raise SystemExit(4)', 'exit')}:TinyModel")
    archs = [*ARCHITECTURES, "CrashesForCausalLM", *together, "RaisesForCausalLM", "ExitsForCausalLM",
             "NoSuchForCausalLM"]

    results = registry.inspect_all(archs, max_workers=len(archs))

    assert list(results) == archs
    for arch in [*ARCHITECTURES, *together]:
        assert isinstance(results[arch], ModelInfo), results[arch]
        assert results[arch].architecture == arch
    assert isinstance(results["CrashesForCausalLM"], ModelInspectionError)
    assert "exited with code 3" in str(results["CrashesForCausalLM"])
    assert isinstance(results["RaisesForCausalLM"], ModelInspectionError)
    assert "ValueError: 42" in str(results["RaisesForCausalLM"])
    assert isinstance(results["ExitsForCausalLM"], ModelInspectionError)  # not a SystemExit here
    assert "SystemExit: 4" in str(results["ExitsForCausalLM"])
    assert isinstance(results["NoSuchForCausalLM"], UnknownArchitectureError)
    assert registry.subprocess_inspections == len(archs) - 1  # every known arch, once


# -- ModelInfo of the bundled architectures --------------------------------------------------------

def test_bundled_model_infos(registry: _ModelRegistry) -> None:
    results = registry.inspect_all(ARCHITECTURES)
    multimodal = {"LlavaForConditionalGeneration"}
    moe = {"MixtralForCausalLM", "Qwen3MoeForCausalLM"}
    for arch in ARCHITECTURES:
        info = results[arch]
        assert isinstance(info, ModelInfo), info
        assert (info.architecture, info.class_name) == (arch, arch)
        assert info.module == registry.models[arch].module_name
        assert info.supports_multimodal == (arch in multimodal), arch
        assert info.is_moe == (arch in moe), arch
        assert info.is_text_generation_model and info.has_example_config and info.supports_tp, arch
        assert not info.supports_pp, arch
        assert info.supports_quantization == (arch not in multimodal), arch  # Llava: see SupportsQuant
        # The subprocess derives exactly what the class says in this process.
        assert info == ModelInfo.from_model_cls(arch, registry.resolve_model_cls(arch))


# -- unknown architectures -------------------------------------------------------------------------

def test_unknown_architecture_suggests_near_matches(registry: _ModelRegistry) -> None:
    with pytest.raises(UnknownArchitectureError) as excinfo:
        registry.inspect_model_cls("LlamaForCausalLm")
    message = str(excinfo.value)
    assert "'LlamaForCausalLm' is not registered" in message
    assert "Did you mean LlamaForCausalLM" in message
    assert "register_model('LlamaForCausalLm'" in message
    with pytest.raises(UnknownArchitectureError, match="Did you mean Qwen2ForCausalLM"):
        registry.resolve_model_cls("Qwen2ForCausalLm")
    with pytest.raises(UnknownArchitectureError) as excinfo:
        registry.inspect_model_cls("Zzzz")
    assert "Did you mean" not in str(excinfo.value)
    assert registry.subprocess_inspections == 0


# -- concurrent writers ----------------------------------------------------------------------------

def _hammer_cache(writer: int, parties: int, barrier: str, entry: RegisteredModel, info: ModelInfo,
                  seconds: float) -> tuple[int, int]:
    """In a child: wait for every writer, then write and read the same cache entry for ``seconds``.

    Returns (writes, reads that found something other than a complete entry).
    """
    registry = _ModelRegistry({info.architecture: entry})
    path = registry._cache_path(info.architecture, entry)
    Path(barrier, str(writer)).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(barrier)) < parties and time.monotonic() < deadline:
        time.sleep(0.005)
    writes = bad_reads = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        registry._write_cache(entry, f"{writer:064x}", info)
        writes += 1
        try:
            data = json.loads(path.read_text())
            ModelInfo.from_dict(data["model_info"])
        except (OSError, ValueError, KeyError, TypeError):
            bad_reads += 1
    return writes, bad_reads


def test_concurrent_writers_never_leave_a_corrupt_file(cache_root: Path, tmp_path: Path) -> None:
    from engine_ref.isolation import run_isolated

    entry = ModelRegistry.models["LlamaForCausalLM"]
    info = ModelInfo.from_model_cls("LlamaForCausalLM", entry.load_model_cls())
    path = _ModelRegistry._cache_path("LlamaForCausalLM", entry)
    barrier = tmp_path / "writers"
    barrier.mkdir()
    parties = 4
    results: dict[int, tuple[int, int] | BaseException] = {}
    done = threading.Event()
    parent_bad_reads: list[str] = []

    def writer(i: int) -> None:
        try:
            results[i] = run_isolated(_hammer_cache, i, parties, str(barrier), entry, info, 0.5, timeout=120)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    def reader() -> None:
        while not done.is_set():
            try:
                json.loads(path.read_text())
            except FileNotFoundError:
                pass
            except ValueError as e:
                parent_bad_reads.append(str(e))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(parties)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()

    for i in range(parties):
        assert isinstance(results[i], tuple), results[i]
        writes, bad_reads = results[i]
        assert writes > 0 and bad_reads == 0, (i, writes, bad_reads)
    assert parent_bad_reads == []
    data = json.loads(path.read_text())
    assert data["source_hash"] in {f"{i:064x}" for i in range(parties)}
    assert ModelInfo.from_dict(data["model_info"]) == info
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind


# -- the prepare-model-info CLI --------------------------------------------------------------------

def _engine_ref_cli() -> list[str]:
    script = Path(sys.executable).with_name("engine-ref")
    return [str(script)] if script.exists() else [sys.executable, "-m", "engine_ref.entrypoints.cli"]


def test_prepare_model_info_cli_warms_the_cache(cache_root: Path) -> None:
    env = {**os.environ, "ENGINE_REF_CACHE_ROOT": str(cache_root)}
    env.pop("ENGINE_REF_PLUGINS", None)

    first = subprocess.run([*_engine_ref_cli(), "prepare-model-info"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    for arch in ARCHITECTURES:
        assert f"ok     {arch}" in first.stdout
    files = cache_files(cache_root)
    assert len(files) == len(ARCHITECTURES)
    written = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}

    # A registry in this process now needs no subprocess for any of them.
    warmed = new_registry()
    for arch in ARCHITECTURES:
        assert warmed.inspect_model_cls(arch).architecture == arch
    assert warmed.subprocess_inspections == 0

    second = subprocess.run([*_engine_ref_cli(), "prepare-model-info"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    # Nothing was inspected again: a new inspection would have replaced the files (new inodes).
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache_files(cache_root)} == written


def test_prepare_model_info_cli_fails_for_an_unknown_architecture(cache_root: Path) -> None:
    env = {**os.environ, "ENGINE_REF_CACHE_ROOT": str(cache_root)}
    out = subprocess.run([*_engine_ref_cli(), "prepare-model-info", "NoSuchForCausalLM"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "FAILED NoSuchForCausalLM" in out.stderr and "is not registered" in out.stderr
