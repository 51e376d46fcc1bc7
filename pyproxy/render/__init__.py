"""Rendering, pure: selected endpoints in, nftables objects out, and what is done with them
before the kernel. objects.py: the table's vocabulary (names, items, base chains);
services.py: the renderer (the skeleton and each service port's objects); ruleset.py: the
slot store, its diffs and the commands; staging.py: a big full sync in bounded
transactions; trace.py: where a connection goes, from the store."""
