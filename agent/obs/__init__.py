"""Observability: metrics, the metrics endpoint, structured logs, sd_notify."""
