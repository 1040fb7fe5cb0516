"""Protobuf's wire format, written: for the tests' stand-ins of the kubelet's gRPC peers
(NVIDIA's device plugin) and for replies to decode. Only what those messages use: varints,
strings and nested messages. (It is read by `enforcer.core.pod_resources.fields`.)"""

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
