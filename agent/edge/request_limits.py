"""Size and content limits on every field of every request, checked before any work.

A request comes from any process that can open the socket, so each string
field has a byte limit, each repeated or map field a count limit, each double
must be finite, and no string may hold a control or bidi character (they end
up in paths, logs and people's terminals). A field without a limit of its own
gets the defaults. The refusal names the field, its size and the limit, and
never repeats the value: a 16 KiB URI must give INVALID_ARGUMENT, not a status
detail too big for gRPC's metadata.
"""

from __future__ import annotations

import math

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from agent._exceptions import InvalidRequest
from agent._uri import MAX_URI_BYTES, forbidden_character

__all__ = ["DEFAULT_COUNT_LIMIT", "DEFAULT_STRING_BYTES", "check_request", "check_text"]

# Generous for a field with no limit of its own (a credential token is a few KiB).
DEFAULT_STRING_BYTES = 8192
DEFAULT_COUNT_LIMIT = 256

# Limits by field name, whatever message the field is in.
_FIELD_BYTES = {
    "uri": MAX_URI_BYTES,
    "ref": MAX_URI_BYTES,  # a URI or a key prefix
    "key": 128,  # snapshot and compile-cache keys are 64 hex digits
    "id": 128,  # lease ids are 32 characters
    "client_name": 256,
    "include": 1024,
    "exclude": 1024,
    "data_plane": 64,
    "waiter_token": 64,  # compared, never stored: 32 random hex digits is plenty
}
# Limits for every string field of a message (compile key parts and their extras).
_MESSAGE_BYTES = {
    "prewarm.v1.CompileKeyParts": 256,
    "prewarm.v1.CompileKeyParts.ExtrasEntry": 256,
}
_FIELD_COUNT = {"include": 256, "exclude": 256, "extras": 64}
_NESTING_LIMIT = 8


def check_request(request: Message) -> None:
    """Raise InvalidRequest naming the first field over its limit or holding a bad character."""
    _check_message(request, request.DESCRIPTOR.name, 0)


def check_text(value: str, where: str, *, like: str) -> None:
    """Check a string that arrives outside a protobuf message as the API checks field ``like``.

    The lease socket's hello carries a client name and a lease id: the same
    limits and characters apply there as to ``client_name`` and ``id`` here.
    """
    _check_string(value, where, _FIELD_BYTES.get(like, DEFAULT_STRING_BYTES))


def _check_message(message: Message, where: str, depth: int) -> None:
    if depth > _NESTING_LIMIT:
        raise InvalidRequest(f"{where} is nested deeper than {_NESTING_LIMIT} messages.")
    for field, value in message.ListFields():
        name = f"{where}.{field.name}"
        if not field.is_repeated:
            _check_value(field, value, name, depth)
            continue
        limit = _FIELD_COUNT.get(field.name, DEFAULT_COUNT_LIMIT)
        if len(value) > limit:
            raise InvalidRequest(
                f"{name} has {len(value)} entries, over the limit of {limit}. "
                "Send fewer (e.g. one broader glob instead of many)."
            )
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            for key, item in value.items():
                _check_value(entry.fields_by_name["key"], key, f"{name} key", depth)
                _check_value(entry.fields_by_name["value"], item, f"{name} value", depth)
        else:
            for item in value:
                _check_value(field, item, name, depth)


def _check_value(field: FieldDescriptor, value: object, name: str, depth: int) -> None:
    if isinstance(value, Message):
        _check_message(value, name, depth + 1)
    elif isinstance(value, str):
        _check_string(value, name, _string_limit(field))
    elif isinstance(value, bytes) and len(value) > DEFAULT_STRING_BYTES:
        raise InvalidRequest(
            f"{name} is {len(value)} bytes long, over the limit of {DEFAULT_STRING_BYTES} bytes."
        )
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{name} is {value}; it must be a finite number.")


def _check_string(value: str, name: str, limit: int) -> None:
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise InvalidRequest(f"{name} is {size} bytes long, over the limit of {limit} bytes.")
    found = forbidden_character(value)
    if found is not None:
        raise InvalidRequest(f"{name} contains {found}; control and bidi characters are refused.")


def _string_limit(field: FieldDescriptor) -> int:
    # A map entry's key and value are fields of the entry message, so the
    # per-message limits cover them too.
    owner = field.containing_type
    by_message = _MESSAGE_BYTES.get(owner.full_name) if owner is not None else None
    if by_message is not None:
        return by_message
    return _FIELD_BYTES.get(field.name, DEFAULT_STRING_BYTES)
