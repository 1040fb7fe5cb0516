"""Protobuf's wire format, written: for the tests' stand-ins of the kubelet's gRPC peers
(NVIDIA's device plugin) and for replies to decode. Only what those messages use: varints,
strings and nested messages."""

from __future__ import annotations


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, value: bytes | str) -> bytes:
    """A length-delimited field: a string, bytes, or a message already written."""
    data = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(data)) + data


def number_field(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def fields(data: bytes) -> list[tuple[int, bytes | int]]:
    """A message's top-level fields, read back (varints and length-delimited only)."""
    found: list[tuple[int, bytes | int]] = []
    at = 0

    def read_varint() -> int:
        nonlocal at
        value, shift = 0, 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while at < len(data):
        key = read_varint()
        if key & 7 == 0:
            found.append((key >> 3, read_varint()))
        else:
            size = read_varint()
            found.append((key >> 3, data[at : at + size]))
            at += size
    return found
