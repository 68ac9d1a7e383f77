"""Content checks that need no network: content hashes, safetensors headers."""
