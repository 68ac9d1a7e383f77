"""Every S3 source of a process reads botocore's API models from one parse.

botocore parses its JSON files (the S3 model, endpoint rules, partitions) into
a cache of the session's loader; the agent makes a session per source (the
node's, and one per requester's keys), so each source parsed them again. Now
every session gets the process's loader (``agent.source.sessions``); what each
source signs with stays its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import botocore

from agent._config import S3Settings
from agent.source.s3 import S3Source

_BOTOCORE_DATA = str(Path(botocore.__file__).parent / "data")
# Where the files opened go while a test asks (an audit hook cannot be removed: it
# records only then).
_recording: list[list[str]] = []


def _record_open(event: str, args: tuple[object, ...]) -> None:
    if _recording and event == "open" and isinstance(args[0], str):
        _recording[-1].append(args[0])


sys.addaudithook(_record_open)


async def test_a_second_source_reads_no_api_model_and_signs_with_its_own_keys() -> None:
    """A source built after another (a requester's keys, as an access check builds one)
    opens none of botocore's data files, and its presigned URLs carry its own key id, not
    the node's."""
    settings = S3Settings(endpoint_url="http://127.0.0.1:9", region="us-east-1")
    node_keys = {"aws_access_key_id": "AKIANODE", "aws_secret_access_key": "node-secret"}
    async with S3Source(settings, credentials=node_keys) as node:
        node_url = await node.presign_get("b", "k", etag='"e"', expires_seconds=60)
        opened: list[str] = []
        _recording.append(opened)
        try:
            async with node.with_credentials("AKIAPOD", "pod-secret", "") as pod:
                pod_url = await pod.presign_get("b", "k", etag='"e"', expires_seconds=60)
        finally:
            _recording.remove(opened)
    assert [path for path in opened if path.startswith(_BOTOCORE_DATA)] == []
    assert "Credential=AKIAPOD%2F" in pod_url
    assert "Credential=AKIANODE%2F" in node_url
