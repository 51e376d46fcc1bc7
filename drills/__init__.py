"""Reliability and security drills for pyproxy (docs/drills.md).

`drills.scenarios` holds the drills themselves, parameterised by duration and scale, so the
CI suite (tests/test_drills.py, short versions) and `make chaos` (drills/chaos.py, long
versions that print the figures) run the same code.
"""
