"""The sync: the core that checks changes out and syncs, per-family selection + rendering,
the runner."""
