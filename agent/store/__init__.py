"""The node cache on disk: tiers, snapshots, journal, budget, eviction, leases."""
