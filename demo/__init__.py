"""`make demo`: the real daemon on a namespace cluster (demo/run.py; `python -m demo.run`
from the repository root).
"""
