"""What the daemon serves: health, metrics, connection counts, the debug socket and its answers."""
