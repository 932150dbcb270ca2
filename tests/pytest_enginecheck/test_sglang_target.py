"""The SGLang target's pure parts, tested without SGLang (the project venv has none): module discovery and the
``EntryClass`` parse on fake package trees, the inspect requirements on toy classes, the children's environment,
the verdict on what SGLang's registry served, and what the target offers. What needs SGLang is the sglang tier
(``tests/sglang``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_enginecheck.targets import Offer, load_target
from pytest_enginecheck.targets.sglang import SglangTarget, architecture_entries
from pytest_enginecheck.targets.sglang.discovery import (
    DiscoveryError,
    ModelModule,
    discover,
    package_paths,
    parse_module,
)
from pytest_enginecheck.targets.sglang.env import (
    EMPTY_PACKAGE,
    EXTERNAL_VARIABLE,
    USER_PACKAGE_VARIABLE,
    engine_environment,
    external_package,
    prepare_environment,
)
from pytest_enginecheck.targets.sglang.plugins import registry_verdict
from pytest_enginecheck.targets.sglang.preload import named_imports, shared_names
from pytest_enginecheck.targets.sglang.requirements import served_with, unmet

# --- discovery: the modules SGLang's scan imports, and their EntryClass, without importing them -----------------

MODULES = {
    "single.py": "class OneForCausalLM:\n    pass\n\nEntryClass = OneForCausalLM\n",
    "several.py": "class A:\n    pass\n\nclass B(A):\n    pass\n\nEntryClass = [A, B]\n",
    "aliased.py": ("from elsewhere import Original as Imported\n\nclass Base:\n    pass\n\nAlias = Base\n"
                   "Again = Alias\n\nEntryClass = [Imported, Again]\n"),
    "annotated.py": "class C:\n    pass\n\nEntryClass: list = [C]\n",
    "helper.py": "def helper() -> int:\n    return 1\n",
    "opaque.py": "def make() -> list:\n    return []\n\nEntryClass = make()\n",
    "reexport.py": "from single import EntryClass\n",
    "disabled.py": "class D:\n    pass\n\nEntryClass = D\n",
    "raises.py": ("raise RuntimeError('imported: discovery must not import modules')\n"
                  "class E:\n    pass\nEntryClass = E\n"),
}


@pytest.fixture
def fake_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``fakeorg.sub.models``: a namespace package above a regular one holding MODULES and a subpackage."""
    models = tmp_path / "fakeorg" / "sub" / "models"
    (models / "subpackage").mkdir(parents=True)
    (tmp_path / "fakeorg" / "__init__.py").write_text("raise RuntimeError('the parent package must not run')\n")
    (models / "__init__.py").write_text("raise RuntimeError('the package must not run')\n")
    (models / "subpackage" / "__init__.py").write_text("EntryClass = None\n")
    for name, source in MODULES.items():
        (models / name).write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SGLANG_DISABLED_MODEL_ARCHS", "disabled, other")
    return "fakeorg.sub.models"


def test_discovery_lists_what_sglangs_scan_imports_without_importing_anything(fake_models: str) -> None:
    modules = {m.name.rsplit(".", 1)[1]: m for m in discover(fake_models)}
    # plain modules only (no subpackage), minus SGLANG_DISABLED_MODEL_ARCHS, sorted; nothing of it imported
    assert sorted(modules) == ["aliased", "annotated", "helper", "opaque", "raises", "reexport", "several", "single"]
    assert not [name for name in sys.modules if name.startswith("fakeorg")]
    assert modules["single"].classes == (("OneForCausalLM", "OneForCausalLM"),)
    assert modules["several"].classes == (("A", "A"), ("B", "B"))
    assert modules["annotated"].classes == (("C", "C"),)
    assert modules["raises"].classes == (("E", "E"),)
    assert modules["helper"] == ModelModule(modules["helper"].name, modules["helper"].path)  # not an architecture


def test_an_entry_class_name_resolves_to_the_classes_own_name(fake_models: str) -> None:
    """SGLang registers by ``__name__``: an imported alias is the original's name, an assigned one the class's."""
    aliased = next(m for m in discover(fake_models) if m.name.endswith(".aliased"))
    assert aliased.classes == (("Original", "Imported"), ("Base", "Again"))


def test_an_entry_class_the_source_does_not_spell_out_is_opaque(fake_models: str) -> None:
    modules = {m.name.rsplit(".", 1)[1]: m for m in discover(fake_models)}
    assert modules["opaque"].opaque and not modules["opaque"].classes
    assert modules["reexport"].opaque  # bound by an import: only importing it tells what it holds


def test_a_package_that_is_not_there_is_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match=r"'no_such_pkg_xyz.models' is not installed here.*PYTHONPATH"):
        package_paths("no_such_pkg_xyz.models")


def test_a_module_that_does_not_parse_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("EntryClass = [\n")
    with pytest.raises(DiscoveryError, match=r"pkg.bad .*bad.py\) cannot be parsed"):
        parse_module("pkg.bad", str(bad))


def test_architecture_entries_let_the_out_of_tree_package_replace_in_tree_classes() -> None:
    in_tree = [ModelModule("sglang.srt.models.llama", "", (("LlamaForCausalLM", "LlamaForCausalLM"),)),
               ModelModule("sglang.srt.models.odd", "", opaque=True)]
    external = [ModelModule("oot.llama", "", (("LlamaForCausalLM", "LlamaForCausalLM"), ("Mine", "Mine")))]
    entries = {e.architecture: e for e in architecture_entries([in_tree, external])}
    assert entries["LlamaForCausalLM"].module == "oot.llama"  # SGLang: the external package's models win
    assert entries["Mine"].class_name == "Mine"
    odd = entries["sglang.srt.models.odd.EntryClass"]
    assert (odd.module, odd.class_name) == ("sglang.srt.models.odd", "EntryClass")


def test_the_preload_derivation_counts_the_sglang_modules_models_name(tmp_path: Path) -> None:
    sources = {"a": "import sglang.x\nfrom sglang.y import z\nfrom . import rel\nimport os\n",
               "b": "from sglang.y import w\nfrom sglang.models.a import A\n", "c": "import torch\n"}
    modules = []
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
        modules.append(ModelModule(f"sglang.models.{name}", str(tmp_path / f"{name}.py")))
    assert named_imports(str(tmp_path / "a.py")) == {"sglang.x", "sglang.y"}
    assert shared_names(modules, share=0.5) == ["sglang.y"]  # 2 of 3; the model module a is never preloaded
    assert shared_names(modules, share=0.3) == ["sglang.x", "sglang.y"]


# --- inspect: what SGLang's registry, loader and runner need of the class ------------------------------------------

class Served(torch.nn.Module):
    def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()

    def forward(self, input_ids: Any, positions: Any, forward_batch: Any, pp_proxy_tensors: Any = None) -> Any:
        return input_ids

    def load_weights(self, weights: Any) -> set[str]:
        return set()


class NoLoadWeights(torch.nn.Module):
    def __init__(self, config: Any, quant_config: Any = None) -> None:
        super().__init__()

    def forward(self, input_ids: Any, positions: Any, forward_batch: Any) -> Any:
        return input_ids


class NeedsMore(Served):
    def __init__(self, config: Any, quant_config: Any, cache_config: Any) -> None:
        super().__init__(config)

    def forward(self, input_ids: Any, positions: Any) -> Any:  # type: ignore[override]
        return input_ids

    @staticmethod
    def load_weights(weights: Any, strict: bool) -> None:  # type: ignore[override]
        return None


class PositionalOnly(Served):
    def __init__(self, hf_config: Any, /, quant_config: Any = None) -> None:
        super().__init__(hf_config)


class NoForward(torch.nn.Module):
    def __init__(self, config: Any, quant_config: Any = None) -> None:
        super().__init__()

    def load_weights(self, weights: Any) -> None:
        return None


class ForwardAtInit(NoForward):
    """SGLang's Qwen3-Omni way: the instance's forward is the submodel's."""

    def __init__(self, config: Any, quant_config: Any = None) -> None:
        super().__init__(config)
        self.thinker = Served(config)
        self.forward = self.thinker.forward


class Facade:
    """SGLang's MiniCPM-V way: not a torch.nn.Module; every attribute is the model it builds."""

    def __init__(self, config: Any, quant_config: Any = None) -> None:
        self.inner = Served(config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def load_weights(self, weights: Any) -> None:
        return None


def test_a_class_sglang_can_serve_meets_every_requirement() -> None:
    assert unmet(Served, "Served") == []
    assert served_with(Served) == {"pipeline_parallel": True, "input_embeds": False, "get_embedding": False}


@pytest.mark.parametrize(("cls", "architecture", "expected"), [
    (NoLoadWeights, "NoLoadWeights", ["it has no load_weights: SGLang's loader calls model.load_weights(weights)"]),
    (NoForward, "NoForward", ["it has no forward (none defined, none assigned in __init__, no __getattr__): SGLang "
                              "calls model.forward(input_ids, positions, forward_batch)"]),
    (Served, "ServedForCausalLM", ["its __name__ is 'Served': SGLang's registry serves it as that, not as "
                                   "'ServedForCausalLM'"]),
])
def test_each_unmet_requirement_is_one_sentence(cls: type, architecture: str, expected: list[str]) -> None:
    assert unmet(cls, architecture) == expected


def test_a_forward_left_to_the_instance_is_accepted_and_said_so() -> None:
    """SGLang calls forward on the built model only: one assigned in __init__ or delegated by __getattr__ serves."""
    assert unmet(ForwardAtInit, "ForwardAtInit") == [] and served_with(ForwardAtInit) == {"forward": "init"}
    assert unmet(Facade, "Facade") == [] and served_with(Facade) == {"forward": "getattr"}


def test_constructor_forward_and_load_weights_are_bound_as_sglang_calls_them() -> None:
    found = unmet(NeedsMore, "NeedsMore")
    assert len(found) == 3, found
    assert found[0].startswith("SGLang builds it as NeedsMore(config=..., quant_config=...): ")
    assert "cache_config" in found[0]
    assert found[1].startswith("SGLang calls model.load_weights(weights): ") and "strict" in found[1]
    assert found[2].startswith("SGLang calls model.forward(input_ids, positions, forward_batch): ")
    assert "config" in unmet(PositionalOnly, "PositionalOnly")[0]  # SGLang passes config= by keyword


def test_an_entry_that_is_not_a_class_is_named() -> None:
    assert unmet(len, "len") == ["EntryClass holds <built-in function len>, not a class: SGLang's registry "
                                 "registers classes by __name__"]


# --- the children's environment -------------------------------------------------------------------------------

def test_the_children_get_an_empty_external_package_and_the_users_is_kept(tmp_path: Path) -> None:
    env = {EXTERNAL_VARIABLE: "my_models", "PYTHONPATH": "/somewhere", "TRITON_CACHE_DIR": "/mine"}
    prepare_environment(str(tmp_path), env)
    assert env[EXTERNAL_VARIABLE] == EMPTY_PACKAGE and env[USER_PACKAGE_VARIABLE] == "my_models"
    root = env["PYTHONPATH"].split(":")[0]
    assert (Path(root) / EMPTY_PACKAGE / "__init__.py").is_file() and env["PYTHONPATH"].endswith(":/somewhere")
    assert env["TRITON_CACHE_DIR"] == "/mine"  # the user's choice stays
    assert Path(env["SGLANG_CACHE_DIR"]).is_dir() and env["SGLANG_CACHE_DIR"].startswith(str(tmp_path))
    assert external_package(env) == "my_models"
    prepare_environment(str(tmp_path), env)  # a second session in the same environment keeps the user's package
    assert external_package(env) == "my_models"
    engine = engine_environment(env)
    assert engine[EXTERNAL_VARIABLE] == "my_models" and USER_PACKAGE_VARIABLE not in engine


def test_without_an_external_package_none_is_reported_and_sglangs_state_has_none(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    prepare_environment(str(tmp_path), env)
    assert external_package(env) is None and env[EXTERNAL_VARIABLE] == EMPTY_PACKAGE
    assert EXTERNAL_VARIABLE not in engine_environment(env)


# --- the plugins check's verdict on what SGLang's registry served --------------------------------------------------

def test_the_registry_verdict_names_what_sglang_dropped_and_its_log_line() -> None:
    ok, sentence = registry_verdict(("Clean", "Broken"), {"architectures": ["Clean"], "warnings": [
        "Ignore import error when loading oot.broken: boom", "unrelated"]})
    assert not ok
    assert sentence == ("SGLang's registry silently dropped Broken: it logged 'Ignore import error when loading "
                        "oot.broken: boom'")
    assert registry_verdict(("Clean",), {"architectures": ["Clean", "Other"], "warnings": []}) == (
        True, "SGLang's registry serves Clean")


# --- the target ---------------------------------------------------------------------------------------------------

def test_the_target_offers_plugins_import_inspect_and_says_why_not_the_rest() -> None:
    target = load_target("sglang")
    assert isinstance(target, SglangTarget) and target.engine_packages == ("sglang",)
    offer = target.offered()
    assert isinstance(offer, Offer) and offer.checks == ("plugins", "import", "inspect")
    assert offer.sentence() == (
        "load, budget, startup (SGLang has no CPU build on the package index (its CPU backend is a source build for "
        "Xeon AMX CPUs), so its engine cannot start here); lora, quant (not implemented for the SGLang target: it "
        "runs on engine_ref targets)")


def test_the_plugin_count_is_the_external_package(monkeypatch: pytest.MonkeyPatch) -> None:
    target = load_target("sglang")
    monkeypatch.delenv(USER_PACKAGE_VARIABLE, raising=False)
    monkeypatch.setenv(EXTERNAL_VARIABLE, EMPTY_PACKAGE)
    assert target.plugin_count() == 0
    monkeypatch.setenv(EXTERNAL_VARIABLE, "oot_models")
    assert target.plugin_count() == 1


def test_importing_the_target_imports_neither_torch_nor_sglang() -> None:
    code = textwrap.dedent("""\
        import sys
        import pytest_enginecheck.targets.sglang
        from pytest_enginecheck.targets import load_target
        load_target("sglang").offered()
        print(sorted(m for m in ("torch", "sglang") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


# --- the sglang tier cannot go green having run nothing --------------------------------------------------------

TIER_FILE = Path(__file__).parents[1] / "sglang" / "test_sglang_target.py"
without_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                                    reason="SGLang is importable here: the tier runs instead of skipping")


@without_sglang
def test_the_tier_skips_without_sglang(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINECHECK_REQUIRE_SGLANG", raising=False)
    result = pytester.runpytest_subprocess(str(TIER_FILE), "-p", "no:cacheprovider", "-q")
    assert result.ret == pytest.ExitCode.OK
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0 and set(outcomes) <= {"skipped"}, outcomes


@without_sglang
def test_a_missing_sglang_is_an_error_where_the_tier_requires_it(pytester: pytest.Pytester,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINECHECK_REQUIRE_SGLANG", "1")
    result = pytester.runpytest_subprocess(str(TIER_FILE), "-p", "no:cacheprovider", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ENGINECHECK_REQUIRE_SGLANG=1 but SGLang is not importable by *"])
