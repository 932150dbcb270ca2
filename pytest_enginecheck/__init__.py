"""pytest-enginecheck: prove in CPU-only CI that an LLM engine's model startup works.

``pytest --enginecheck`` checks every registered architecture of an engine; the fixtures
(``no_cuda``, ``isolated``, ``multirank``, ``engine``) and markers (``memory_budget``,
``world_size``) let model authors write their own startup tests. Importing this package is cheap:
torch is imported only when a check or fixture needs it.
"""

__version__ = "0.1.0"
