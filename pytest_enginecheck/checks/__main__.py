"""``python -m pytest_enginecheck.checks``: print the README's table of checks (from ``CHECK_SPECS``)."""

from pytest_enginecheck.checks import markdown_table

print(markdown_table())
