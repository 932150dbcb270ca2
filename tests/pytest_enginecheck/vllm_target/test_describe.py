"""The vLLM target's describe room without vLLM: the root line of a registry subprocess's traceback."""

from __future__ import annotations

import textwrap


def test_root_line_is_the_last_exception_line_of_a_traceback() -> None:
    from pytest_enginecheck.targets.vllm.describe.registry import root_line

    text = textwrap.dedent('''\
        Traceback (most recent call last):
          File "/x/registry.py", line 12, in _run
            raise RuntimeError("first")
        RuntimeError: first

        During handling of the above exception, another exception occurred:

        Traceback (most recent call last):
          File "/x/model.py", line 3, in <module>
            import flash_attn
        ModuleNotFoundError: No module named 'flash_attn'
          some trailing log line
        ''')
    assert root_line(text) == "ModuleNotFoundError: No module named 'flash_attn'"
    assert root_line("just one line") == "just one line"
    assert root_line("  \n") == ""
