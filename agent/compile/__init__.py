"""Compile caches: keys, per-key directories, archives, S3 restore and upload, locks."""
