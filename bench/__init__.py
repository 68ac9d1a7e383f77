"""The prewarm benchmark suite: run by hand (``make bench``), never in CI.

One command (``python -m bench``) starts a local S3-compatible server on loopback
(s3rver, installed with npm into ``bench/.cache/``) over HTTP and, on the same
store, over HTTPS with a self-signed certificate; generates and uploads a
synthetic safetensors model, and measures in one run, side by side over each
scheme: the ceiling (parallel raw ranged GETs with curl), what a user would run
instead (s5cmd, boto3's managed download, runai-model-streamer), and prewarm
itself (cold pulls per data plane, with the CPU and memory of the daemon and its
worker processes and the seconds each process holds its interpreter lock; warm
repeat launches, eight concurrent cold clients, and how cold and hit costs
scale). It prints the tables, writes JSON under ``bench/results/`` and the
Markdown for ``docs/benchmarks.md`` beside it.
"""
