"""The pod's own AWS credentials, sent with a request to a requester-scoped socket.

The agent checks with them that the pod may list and read the snapshot it
asks for, so sharing the node's cache never widens what a pod can read.
botocore's standard chain finds them inside the pod (a web-identity token,
EKS Pod Identity, a profile, the environment). This is the client's only use
of botocore, imported when asked, so the client needs it only then.
"""

from __future__ import annotations

from agent._exceptions import InvalidRequest
from agent._proto.prewarm.v1 import prewarm_pb2 as pb

__all__ = ["requester_credentials"]


def requester_credentials() -> pb.RequesterCredentials:
    """The credentials botocore's default chain resolves in this process, frozen now."""
    try:
        import botocore.session
    except ImportError:
        raise InvalidRequest(
            "as_requester=True reads the pod's AWS credentials with botocore, which is not "
            "installed here: pip install botocore."
        ) from None
    found = botocore.session.Session().get_credentials()
    if found is None:
        raise InvalidRequest(
            "as_requester=True found no AWS credentials in this pod (no web-identity token, "
            "Pod Identity, profile or AWS_* variables). Give the pod an identity first."
        )
    # Temporary credentials refresh themselves; frozen ones stay consistent for one request.
    frozen = found.get_frozen_credentials()
    return pb.RequesterCredentials(
        access_key_id=frozen.access_key,
        secret_access_key=frozen.secret_key,
        session_token=frozen.token or "",
    )
