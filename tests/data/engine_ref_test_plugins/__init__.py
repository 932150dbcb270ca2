"""A tiny out-of-tree plugin package for the general-plugin tests (tests/plugin_dists.py).

tests/plugin_dists.py copies it into a temporary site directory next to a ``*.dist-info`` whose
``entry_points.txt`` declares the ``engine_ref.general_plugins`` below, as pip would install it.
Each plugin lives in its own module, so a test can see which ones were even imported.
"""

CALLS: list[str] = []  # the plugins that ran in this process, in order
