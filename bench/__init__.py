"""The prewarm benchmark suite: run by hand (``make bench``), never in CI.

One command (``python -m bench``) starts a local S3-compatible server on loopback
(s3rver, installed with npm into ``bench/.cache/``), generates and uploads a
synthetic safetensors model, and measures in one run, side by side: the ceiling
(parallel raw ranged GETs with curl), what a user would run instead (s5cmd,
boto3's managed download, runai-model-streamer), and prewarm itself (cold pulls
per data plane, warm repeat launches, eight concurrent cold clients, the
daemon's peak RSS, and how cold and hit costs scale). It prints a table, writes
JSON under ``bench/results/`` and can write the Markdown for
``docs/benchmarks.md``.
"""
