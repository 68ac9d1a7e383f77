"""Manifests in models.d: the file format (``schema``), the watcher that prefetches and pins
(``manifests``) and the record of the pins it made (``pins``)."""
