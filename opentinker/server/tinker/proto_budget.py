"""How much a protobuf body would grow when parsed, measured before it is parsed.

Parsing makes an object for every sub-message and an 8-byte slot for every element of a
repeated number, so a body of tiny messages grows many times over: 60 MiB of empty datums
is about 1.7 GB once parsed. :func:`check_parse_budget` walks the body's wire format (tags
and lengths only; ``bytes`` and ``string`` fields are stepped over, never copied) and refuses
it once it names more than ``max_items`` fields, sub-messages and repeated elements, so what
the parser then builds is bounded by the body plus ``max_items`` small objects.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_FIXED_SIZES = {FieldDescriptor.TYPE_DOUBLE: 8, FieldDescriptor.TYPE_FIXED64: 8, FieldDescriptor.TYPE_SFIXED64: 8,
                FieldDescriptor.TYPE_FLOAT: 4, FieldDescriptor.TYPE_FIXED32: 4, FieldDescriptor.TYPE_SFIXED32: 4}
_VARINT_CONTINUATION = bytes(range(128, 256))  # bytes with the high bit set: a varint goes on


class ParseBudgetError(ValueError):
    """The body is malformed, or would make more objects than allowed when parsed."""


def _varint(body: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = body[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ParseBudgetError("a varint runs past its message")


def _packed_count(field: FieldDescriptor, body: bytes, start: int, end: int) -> int:
    size = _FIXED_SIZES.get(field.type)
    if size is not None:
        return (end - start) // size
    # Varints: one element ends at each byte without the continuation bit.
    return (end - start) - len(body[start:end].translate(None, delete=bytes(range(128))))


def check_parse_budget(descriptor: Descriptor, body: bytes, max_items: int) -> None:
    """Raise :class:`ParseBudgetError` when ``body`` (a ``descriptor`` message) holds more than
    ``max_items`` fields, sub-messages and repeated elements, or is not well formed."""
    items = 0
    pending = [(descriptor, 0, len(body))]
    while pending:
        message, pos, end = pending.pop()
        while pos < end:
            key, pos = _varint(body, pos, end)
            number, wire_type = key >> 3, key & 7
            field = message.fields_by_number.get(number)
            items += 1
            if wire_type == 0:
                _, pos = _varint(body, pos, end)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(body, pos, end)
                if pos + length > end:
                    raise ParseBudgetError("a length-delimited field runs past its message")
                if field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
                    pending.append((field.message_type, pos, pos + length))
                elif field is not None and field.is_repeated and field.type not in (
                        FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
                    items += _packed_count(field, body, pos, pos + length)
                pos += length
            else:  # groups (3, 4) are not in these messages; 6 and 7 do not exist
                raise ParseBudgetError(f"wire type {wire_type} (field {number}) is not used by this message")
            if items > max_items:
                raise ParseBudgetError(f"the body holds more than {max_items} fields, messages and repeated values")
        if pos > end:
            raise ParseBudgetError("a fixed-size field runs past its message")
