"""Rendering, pure: selected endpoints in, nftables objects out, and what is done with them
before the kernel. objects.py: the table's vocabulary (names, items, base chains);
skeleton.py: the render configuration, the skeleton every table holds, the item constructors
and the names of a service port's own objects; services.py: each service port's objects;
picks.py: the pick chains that choose an endpoint's slot; ruleset.py: the
slot store, its diffs and the commands; staging.py: a big full sync in bounded
transactions; trace.py: where a connection goes, from the store."""
