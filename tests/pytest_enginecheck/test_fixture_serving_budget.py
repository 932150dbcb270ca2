"""The ``engine`` fixture's ``memory_budget`` over the requests an author's test serves, not only at startup: a model
whose decode steps allocate more than the budget (zoo.planted_budget's 768 MiB decode-only scratch, invisible to
startup's profile run) fails the test's teardown naming the decode steps and every rank, at TP 1 and 2; its clean
twin (a 64 MiB scratch at the same place) passes, and without the marker nothing is measured. The models reach the
fixture as an author's would: a general plugin of another distribution registers them.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.helpers import install_engine_ref_plugin
from tests.zoo_sessions import ZOO

PLUGIN = "serving_budget_plugin"

TESTS = """
import pytest

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]


@pytest.mark.memory_budget(per_rank="512MiB")
@pytest.mark.parametrize("tp", [1, 2])
def test_decode_scratch(engine, tp):
    llm = engine("DecodeScratchLlamaForCausalLM", tensor_parallel_size=tp, max_model_len=128)
    assert [len(out) for out in llm.generate(PROMPTS, max_tokens=4, ignore_eos=True)] == [4, 4]


@pytest.mark.memory_budget(per_rank="512MiB")
def test_freed_scratch(engine):
    llm = engine("FreedScratchLlamaForCausalLM", max_model_len=128)
    assert [len(out) for out in llm.generate(PROMPTS, max_tokens=4, ignore_eos=True)] == [4, 4]


def test_decode_scratch_without_a_budget(engine):
    llm = engine("DecodeScratchLlamaForCausalLM", max_model_len=128)
    assert [len(out) for out in llm.generate(PROMPTS, max_tokens=4, ignore_eos=True)] == [4, 4]
"""


def test_the_engine_fixture_holds_the_requests_a_test_serves_to_the_budget(pytester: pytest.Pytester,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(ZOO, pytester.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    site = pytester.path / "site"
    site.mkdir()
    install_engine_ref_plugin(site, PLUGIN, "serving", """
        from engine_ref.model_executor.models.registry import ModelRegistry
        for name in ('DecodeScratchLlamaForCausalLM', 'FreedScratchLlamaForCausalLM'):
            ModelRegistry.register_model(name, f'zoo.planted_budget:{name}')
    """)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), str(pytester.path),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ENGINE_REF_PLUGINS", "serving")
    pytester.makepyfile(test_serving=TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", "test_serving.py", timeout=600)
    output = result.stdout.str()
    result.assert_outcomes(passed=4, errors=2)
    for tp in (1, 2):
        result.stdout.fnmatch_lines([f"test_serving.py::test_decode_scratch[[]{tp}[]] ERROR*"])
        found = re.search(rf"ERROR at teardown of test_decode_scratch\[{tp}\] _+\n(.*?)\n[_=]{{3,}}", output, re.S)
        assert found is not None, output
        section = found[1]
        assert ("memory_budget(per_rank='512MiB'): the engine fits at startup but not while serving this test's "
                "requests: ") in section, section
        for rank in range(tp):
            assert re.search(rf"rank {rank} needs 7\d\d\.\d\d MiB in decode steps \(weights [\d.]+ KiB, activations "
                             r"7\d\d\.\d\d MiB where the profile run measured", section), section
        assert f"rank {tp}" not in section and "in prefill steps" not in section
    result.stdout.fnmatch_lines(["test_serving.py::test_freed_scratch PASSED*",
                                 "test_serving.py::test_decode_scratch_without_a_budget PASSED*"], consecutive=False)
