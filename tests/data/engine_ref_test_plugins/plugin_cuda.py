"""General plugin 'cuda': its module imports a module that imports one that initialises CUDA at import."""

from engine_ref_test_plugins import CALLS, cuda_layers  # noqa: F401 - the import is the bug under test


def register() -> None:
    CALLS.append("cuda")
