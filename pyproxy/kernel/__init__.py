"""The kernel: libnftables and the applier, nftables change events, netlink, conntrack,
connection counters, host settings."""
