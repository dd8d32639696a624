"""What ``relayd status|leases|top --json`` print: a status message as plain JSON values.

``MessageToDict`` writes 64-bit integers as strings (the proto3 JSON mapping)
and enum values by their full proto names (``LEASE_STATE_PUBLISHED``) while the
daemon's own string fields say ``published``; a script reading the output
would have to know both. Here numbers stay numbers and every enum value is
its short lower-case name, the spelling the tables and metrics use.
"""

from __future__ import annotations

import re
from typing import Any

from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from relayd_client.wire.proto import relay_pb2 as pb

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def fetch_status(socket_path: str, timeout: float = 5.0) -> pb.StatusResponse:
    """The daemon's Status reply on ``socket_path``, through an operator session."""
    from .operator import operator_session

    with operator_session(socket_path, timeout) as op:
        return op.status(timeout)


def status_dict(reply: pb.StatusResponse) -> dict[str, Any]:
    """``reply`` as :mod:`relayd.status_tables` reads it: ``MessageToDict`` with the
    proto's field names and every field, set or not."""
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def enum_value_name(enum: EnumDescriptor | None, number: int) -> str:
    """``LeaseState`` 2 -> ``"published"``: the value's name without its type prefix."""
    value = None if enum is None else enum.values_by_number.get(number)
    if enum is None or value is None:
        return str(number)
    prefix = _CAMEL.sub("_", enum.name).upper() + "_"
    name = value.name
    return (name[len(prefix) :] if name.startswith(prefix) else name).lower()


def _value(field: Any, value: Any) -> Any:
    """``field`` is a FieldDescriptor (pure-Python or upb; their stubs differ)."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return enum_value_name(field.enum_type, value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return bytes(value).hex()
    return value


def to_plain(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` (unset ones at their defaults) as JSON-ready values."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            value_field = entry.fields_by_name["value"]
            out[field.name] = {str(k): _value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not msg.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _value(field, value)
    return out
