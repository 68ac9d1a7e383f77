"""The test infrastructure itself: S3Server, its request log, and the sample models."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from agent.testing import (
    CONTROL_PATH,
    S3Server,
    SampleModel,
    make_safetensors_model,
    upload_directory,
)

MiB = 1024 * 1024


def _refuses_connections(server: S3Server) -> bool:
    try:
        with socket.create_connection((server.host, server.port), timeout=5):
            return False
    except ConnectionRefusedError:
        return True


def test_put_then_get_returns_the_same_bytes(s3_client: Any, bucket: str) -> None:
    """The server stores an object and serves back exactly its bytes."""
    body = bytes(range(256)) * 1000
    s3_client.put_object(Bucket=bucket, Key="a/b.bin", Body=body)

    got = s3_client.get_object(Bucket=bucket, Key="a/b.bin")["Body"].read()

    assert got == body


def test_ranged_get_is_recorded_with_its_range_and_byte_count(
    s3_server: S3Server, s3_client: Any, bucket: str
) -> None:
    """A ranged GET lands in the request log with key, Range header, 206 status and bytes sent."""
    s3_client.put_object(Bucket=bucket, Key="w.bin", Body=b"x" * 100_000)

    response = s3_client.get_object(Bucket=bucket, Key="w.bin", Range="bytes=1000-5999")
    assert len(response["Body"].read()) == 5000

    gets = [r for r in s3_server.requests(bucket=bucket) if r.method == "GET"]
    assert len(gets) == 1
    assert (gets[0].key, gets[0].range, gets[0].status) == ("w.bin", "bytes=1000-5999", 206)
    assert gets[0].bytes_sent == 5000
    assert gets[0].complete


def test_request_log_decodes_keys_and_keeps_query_and_if_match(
    s3_server: S3Server, s3_client: Any, bucket: str
) -> None:
    """The log holds keys decoded to UTF-8, a listing's query string and the If-Match header."""
    etag = s3_client.put_object(Bucket=bucket, Key="dir/ünï code.bin", Body=b"1")["ETag"]
    s3_client.get_object(Bucket=bucket, Key="dir/ünï code.bin", IfMatch=etag)["Body"].read()
    s3_client.list_objects_v2(Bucket=bucket, Prefix="dir/")

    get, listing = [r for r in s3_server.requests(bucket=bucket) if r.method == "GET"]

    assert (get.key, get.if_match) == ("dir/ünï code.bin", etag)
    assert listing.key is None
    assert listing.query_params["list-type"] == "2"
    assert listing.query_params["prefix"] == "dir/"


def test_requests_filtered_by_bucket_leave_out_other_buckets(
    s3_server: S3Server, s3_client: Any, bucket: str
) -> None:
    """requests(bucket=...) returns only that bucket's requests."""
    other = f"{bucket[:50]}-other"
    s3_client.create_bucket(Bucket=other)
    s3_client.put_object(Bucket=other, Key="k", Body=b"1")
    s3_client.put_object(Bucket=bucket, Key="k", Body=b"2")

    mine = s3_server.requests(bucket=bucket)

    assert {r.bucket for r in mine} == {bucket}
    assert [r.method for r in mine if r.key == "k"] == ["PUT"]
    s3_client.delete_object(Bucket=other, Key="k")
    s3_client.delete_bucket(Bucket=other)


def test_clear_requests_empties_the_log(s3_server: S3Server, s3_client: Any, bucket: str) -> None:
    """clear_requests() forgets every request logged before it."""
    s3_client.put_object(Bucket=bucket, Key="k", Body=b"1")
    assert s3_server.requests()

    s3_server.clear_requests()

    assert s3_server.requests() == []


def test_control_path_is_not_logged_and_not_an_s3_bucket(s3_server: S3Server) -> None:
    """Reading or clearing the log is not itself logged, and its path can never be a bucket."""
    s3_server.clear_requests()
    s3_server.requests()

    assert s3_server.requests() == []
    assert "_" in CONTROL_PATH.split("/")[1]  # S3 bucket names cannot contain "_"


@pytest.mark.slow
def test_download_cut_short_records_only_the_bytes_written(
    s3_server: S3Server, s3_client: Any, bucket: str
) -> None:
    """A download the client abandons is logged with the bytes actually written, not the object
    size.
    """
    size = 64 * MiB
    s3_client.put_object(Bucket=bucket, Key="big.bin", Body=b"\0" * size)
    s3_server.clear_requests()

    body = s3_client.get_object(Bucket=bucket, Key="big.bin")["Body"]
    body.read(MiB)
    body.close()  # drops the connection with most of the object unread

    (get,) = s3_server.requests(bucket=bucket, settle=30.0)
    assert get.complete
    assert MiB <= get.bytes_sent < size


def test_stop_makes_the_endpoint_refuse_connections(stoppable_s3: S3Server) -> None:
    """stop() ends the server so its port refuses connections; a second stop() is harmless."""
    assert not _refuses_connections(stoppable_s3)

    stoppable_s3.stop()

    assert not stoppable_s3.running
    assert _refuses_connections(stoppable_s3)
    stoppable_s3.stop()  # idempotent


def test_kill_makes_the_endpoint_refuse_connections(stoppable_s3: S3Server) -> None:
    """kill() ends the server at once so its port refuses connections."""
    stoppable_s3.kill()

    assert _refuses_connections(stoppable_s3)


def test_start_after_stop_serves_again_on_the_same_port_but_empty(
    stoppable_s3: S3Server,
) -> None:
    """start() after stop() binds the same port again, with none of the old buckets."""
    client = stoppable_s3.client()
    client.create_bucket(Bucket="before-restart")
    endpoint = stoppable_s3.endpoint_url
    stoppable_s3.stop()

    stoppable_s3.start()

    assert stoppable_s3.endpoint_url == endpoint
    assert client.list_buckets()["Buckets"] == []
    client.close()


def test_env_lets_another_process_reach_the_server(
    s3_server: S3Server, s3_client: Any, bucket: str
) -> None:
    """env() is all another process's boto3 needs to reach the server (path-style addressing
    included).
    """
    s3_client.put_object(Bucket=bucket, Key="hello.txt", Body=b"hi")
    program = (
        "import boto3, sys; "
        "c = boto3.client('s3'); "
        f"body = c.get_object(Bucket='{bucket}', Key='hello.txt')['Body']; "
        "sys.stdout.write(body.read().decode())"
    )
    env = {"PATH": "/usr/bin:/bin", **s3_server.env()}

    result = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True
    )

    assert result.stdout == "hi"
    assert env["PREWARM_S3__ADDRESSING_STYLE"] == "path"


def test_make_safetensors_model_output_loads_back_equal(tmp_path: Path) -> None:
    """The generated shards load back with safetensors into the tensors the generator returned."""
    tensors = make_safetensors_model(tmp_path, total_bytes=4 * MiB, shards=2, seed=7)

    loaded: dict[str, np.ndarray[Any, Any]] = {}
    for shard in sorted(tmp_path.glob("*.safetensors")):
        loaded.update(load_file(shard))

    assert loaded.keys() == tensors.keys()
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype, name
        assert np.array_equal(loaded[name], array), name


def test_make_safetensors_model_writes_the_hugging_face_layout(tmp_path: Path) -> None:
    """The generated model has the Hugging Face files, an index naming every tensor, mixed dtypes
    and about the asked size.
    """
    tensors = make_safetensors_model(tmp_path, total_bytes=6 * MiB, shards=3)

    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == tensors.keys()
    assert "model.layers.0.mlp.up_proj.weight" in tensors
    assert {str(t.dtype) for t in tensors.values()} == {"float16", "float32"}
    shard_bytes = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert 0.95 * 6 * MiB <= shard_bytes <= 1.01 * 6 * MiB


def test_make_safetensors_model_is_deterministic_per_seed(tmp_path: Path) -> None:
    """The same seed generates the same tensors; another seed other ones."""
    first = make_safetensors_model(tmp_path / "a", total_bytes=MiB, shards=1, seed=3)
    again = make_safetensors_model(tmp_path / "b", total_bytes=MiB, shards=1, seed=3)
    other = make_safetensors_model(tmp_path / "c", total_bytes=MiB, shards=1, seed=4)

    name = "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(first[name], again[name])
    assert not np.array_equal(first[name], other[name])


def test_upload_directory_puts_every_file_under_the_prefix(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """upload_directory puts every file, subdirectories included, under the prefix (leading slash
    dropped).
    """
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub" / "b.txt").write_text("b")

    keys = upload_directory(s3_client, bucket, "/models/x/", tmp_path)

    assert keys == ["models/x/a.txt", "models/x/sub/b.txt"]
    listed = s3_client.list_objects_v2(Bucket=bucket)["Contents"]
    assert sorted(o["Key"] for o in listed) == keys


def test_small_model_fixture_is_uploaded_under_models_small(
    small_model: SampleModel, s3_client: Any
) -> None:
    """The small_model fixture is a ~8 MiB, 3-shard model listed under models/small/."""
    assert small_model.uri == f"s3://{small_model.bucket}/models/small/"
    listed = s3_client.list_objects_v2(Bucket=small_model.bucket, Prefix="models/small/")
    assert sorted(o["Key"] for o in listed["Contents"]) == small_model.keys
    assert len([k for k in small_model.keys if k.endswith(".safetensors")]) == 3
    assert 7 * MiB < small_model.total_bytes < 9 * MiB
