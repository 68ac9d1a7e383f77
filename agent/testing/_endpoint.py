"""What a process or a boto3 client needs to talk to an S3 server on loopback.

Shared by the tests' moto server and the benchmark's s3rver: the same
environment (with a developer's ``~/.aws`` shut out) and the same client, each
for its own credentials.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["LoopbackEndpoint", "fresh_session"]


def fresh_session(access_key: str, secret_key: str, region: str) -> Any:
    """A boto3 session of its own for these credentials, reading API models from a shared cache.

    A fresh session ignores whatever the default session picked up; parsing
    botocore's service models again for each one cost about 80 ms a client,
    paid by hundreds of tests. The loader is the one part shared, the agent's
    own (``agent.source.sessions``): it only reads botocore's own JSON files.
    """
    import boto3.session
    import botocore.session

    from agent.source.sessions import api_model_loader

    core = botocore.session.Session()
    core.register_component("data_loader", api_model_loader(core.get_config_variable("data_path")))
    return boto3.session.Session(
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        botocore_session=core,
    )


@dataclass(frozen=True)
class LoopbackEndpoint:
    """An S3 endpoint URL with the static credentials and region that open it."""

    url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The environment a process (the agent, the CLI, a contender) needs to use it."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            # A developer's ~/.aws must not leak profiles, endpoints or
            # addressing settings into the run.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            # Loopback servers serve path-style only; virtual hosts would need
            # DNS for <bucket>.127.0.0.1.
            "PREWARM_S3__ADDRESSING_STYLE": "path",
        }

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client (path-style); ``config`` adds botocore Config options."""
        from botocore.config import Config

        options: dict[str, Any] = {"s3": {"addressing_style": "path"}}
        options.update(config)
        session = fresh_session(self.access_key, self.secret_key, self.region)
        return session.client("s3", endpoint_url=self.url, config=Config(**options))
