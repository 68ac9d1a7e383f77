"""Allowlist bypass by URI spelling (issue 11, second pass): none found, and these pin it.

A tenant allowed `s3://models-prod/team-a/` and `s3://models-prod/shared/*` tries to reach
another prefix or bucket through `..`, percent-encoding, case, trailing dots, lookalikes,
doubled slashes and userinfo/port forms. Each spelling is either refused as a URI or denied;
the ones allowed name keys that S3 keeps literally under the allowed prefix.
"""

from __future__ import annotations

import pytest

from agent._config import AccessLimits
from agent._exceptions import InvalidRequest
from agent._uri import parse_uri
from agent.service.access import PullGate, Tenant

TENANT = Tenant(
    "team-a",
    ("s3://models-prod/team-a/", "s3://models-prod/shared/*"),
    (),
    AccessLimits(),
    AccessLimits(),
    PullGate(0),
)
REFUSED_AS_URIS = [
    "s3://models-prod/team-a/../team-b/",
    "s3://models-prod/shared/../team-b/",
    "s3://models-prod/team-a/./x/",
    "s3://Models-Prod/team-b/",
    "s3://models-prod./team-a/",
    "s3:/models-prod/team-a/",
    "s3://models-prod:443/team-a/",
    "s3://user@models-prod/team-a/",
    "s3://models-prod/team-a/?x=1",
    "s3://models-prod/team-a/#f",
    "s3://models-prod/team-a/\x00/",
    "s3://models-prod/\u202eteam-a/",
]
DENIED = [
    "s3://models-prod/team-a%2F..%2Fteam-b/",
    "S3://models-prod/team-b/",
    "s3://models-prod/team-a./",
    "s3://models-prod/TEAM-A/",
    "s3://models-prod/team-\uff41/",  # fullwidth a
    "s3://models-prod/team-a\u200b/",  # zero-width space
    "s3://models-prod/team-ab/",
    "s3://models-prod/shared*/",
    "s3://models-prod/sharedX/",
    "s3://models-prod/shared%2Fx/",
    "s3://models-prod-evil/team-a/",
    "s3://models-prod",
    "s3://models-prod/",
    "s3://models-prod/team-a\\../team-b/",
    "s3://models-prod/ team-a/",
    "s3://models-prod/team-a /",
    "s3://xn--models-prod/team-a/",
]
# Allowed, and each one's listing prefix stays under team-a/ or shared/ as S3 reads it.
ALLOWED_INSIDE = {
    "s3://models-prod//team-a/": "team-a/",
    "s3://models-prod/team-a//": "team-a/",
    "s3://models-prod/team-a": "team-a/",
    "s3://models-prod/team-a/%2e%2e/team-b/": "team-a/%2e%2e/team-b/",
    "s3://models-prod/team-a/..%2f/": "team-a/..%2f/",
    "s3://models-prod/team-a/\u0338../": "team-a/\u0338../",
    "s3://models-prod/shared": "shared/",
}


@pytest.mark.parametrize("uri", REFUSED_AS_URIS)
def test_spellings_that_are_not_plain_s3_prefixes_are_refused(uri: str) -> None:
    """`..`, `.`, case, trailing dots, ports, userinfo, queries, NUL and bidi are not URIs here."""
    with pytest.raises(InvalidRequest):
        parse_uri(uri)


@pytest.mark.parametrize("uri", DENIED)
def test_spellings_of_other_prefixes_and_buckets_are_denied(uri: str) -> None:
    """Encoded separators, case, lookalikes and neighbours of allowed names are denied."""
    assert not TENANT.allows(parse_uri(uri))


@pytest.mark.parametrize(("uri", "prefix"), ALLOWED_INSIDE.items())
def test_allowed_spellings_list_only_under_the_allowed_prefix(uri: str, prefix: str) -> None:
    """What is allowed normalises to a prefix inside the allowed directory, compared literally."""
    parsed = parse_uri(uri)
    assert TENANT.allows(parsed)
    assert (parsed.bucket, parsed.prefix) == ("models-prod", prefix)
