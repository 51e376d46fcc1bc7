"""Where the cluster state comes from: API watches and requests, a snapshot file, change
tracking, Events."""
