"""Manifests in models.d: parsing and the watcher that prefetches and pins."""
