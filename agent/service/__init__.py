"""The agent's operations (ensure, list, evict, verify, leases), free of gRPC."""
