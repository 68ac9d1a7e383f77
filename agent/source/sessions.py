"""aiobotocore sessions that read botocore's API models once per process.

botocore parses its JSON files (the S3 service model, the endpoint rules, the
partitions) into a cache held by the session's loader, and every session makes
a loader of its own. The agent makes a session per source: the node's, and one
for each requester whose keys an access check or a pull signs with, so each
parsed them again (about 0.1 s of CPU a source). ``new_session`` hands every
session one loader per data path instead, the path botocore itself would have
used (``AWS_DATA_PATH`` or the config file's ``data_path``).

Nothing of a tenant goes through it: the loader reads only those JSON files and
keeps what it parsed. Credentials, configuration, the credential chain's cache,
clients and their connections stay with each session.
"""

from __future__ import annotations

import functools

from aiobotocore.session import AioSession
from botocore.loaders import Loader, create_loader

__all__ = ["api_model_loader", "new_session"]


def new_session() -> AioSession:
    """A new aiobotocore session whose loader is the process's (``api_model_loader``)."""
    session = AioSession()
    data_path = session.get_config_variable("data_path")
    session.register_component("data_loader", api_model_loader(data_path))
    return session


@functools.cache
def api_model_loader(data_path: str | None = None) -> Loader:
    """The one botocore loader of this process for ``data_path`` (None: botocore's own data)."""
    return create_loader(data_path)
