"""Leases: who holds which snapshot, for how long, and what survives a restart of the agent.

``table`` is the lease table (grants, renewals, expiry, per-socket caps, the
capability ids), ``holders`` tells a live holder process from a reused pid,
``held_file`` keeps the leases held open on the lease socket in a file, and
``keeper`` saves and restores them across a restart. Leases know snapshots only
by key: they import nothing of the catalog or the tiers (agent.store), which
asks them what is leased before it evicts.
"""
