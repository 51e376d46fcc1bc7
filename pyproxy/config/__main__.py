"""`python -m pyproxy.config > docs/configuration.md`: the reference, from the table of settings."""

from pyproxy.config import reference_markdown

print(reference_markdown(), end="")
