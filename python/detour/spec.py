"""Job specs from dicts, JSON files and messages.

A spec is the proto3 JSON mapping of ``detour.v1.JobSpec``, exactly what
``detourctl submit SPEC.json`` reads (docs/API.md §Spec files): field names
as in the .proto or lowerCamelCase, enums by name, unknown fields refused.
Defaults and range checks are the coordinator's: it validates every spec it
is given and names the offending field.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, Callable, List, Mapping, Optional, Tuple, Union

from google.protobuf import json_format

from detour._proto.detour.v1 import spec_pb2
from detour.errors import InvalidSpec

__all__ = ["SpecLike", "load_spec"]

# What submit() takes: a dict in the JSON form, the path of a JSON file, or
# a JobSpec message.
SpecLike = Union[Mapping[str, Any], str, "os.PathLike[str]", spec_pb2.JobSpec]

_MAX_SPEC_FILE_BYTES = 1 << 20  # the coordinator refuses larger specs anyway


def load_spec(spec: SpecLike) -> spec_pb2.JobSpec:
    """The JobSpec message for `spec`.

    Raises:
        InvalidSpec: the dict or file is not a JobSpec in the JSON form (bad
            JSON, an unknown field, a value of the wrong type); ``field``
            names the field where one is to blame.
        OSError: the file cannot be read.
        TypeError: `spec` is none of the accepted types.
    """
    if isinstance(spec, spec_pb2.JobSpec):
        copy = spec_pb2.JobSpec()
        copy.CopyFrom(spec)
        return copy
    if isinstance(spec, Mapping):
        mapping = dict(spec)
        return _parse(lambda m: json_format.ParseDict(mapping, m), "spec")
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        with open(path, "rb") as f:
            data = f.read(_MAX_SPEC_FILE_BYTES + 1)
        if len(data) > _MAX_SPEC_FILE_BYTES:
            raise InvalidSpec("%s: more than %d bytes; a spec is at most 1 MiB"
                              % (path, _MAX_SPEC_FILE_BYTES))
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidSpec("%s: not UTF-8 text (byte %d)" % (path, e.start)) from None
        return _parse(lambda m: json_format.Parse(text, m), path)
    raise TypeError("a spec is a dict, the path of a JSON file or a detour.v1.JobSpec, not %s"
                    % type(spec).__name__)


def _parse(parse: Callable[[spec_pb2.JobSpec], Any], what: str) -> spec_pb2.JobSpec:
    message = spec_pb2.JobSpec()
    try:
        parse(message)
    except json_format.ParseError as e:
        field, problem = describe_parse_error(str(e))
        where = "%s: %s" % (what, field) if field else what
        raise InvalidSpec("%s: %s" % (where, problem), field=field) from None
    return message


_NESTED = re.compile(r"Failed to parse (\w+) field: ")
_UNKNOWN = re.compile(r'Message type "([\w.]+)" has no field named "([^"]*)"')
_TRAILER = re.compile(r"\s+at [\"']?[\w.\[\]]+[\"']?\.*$")
_ENUM = re.compile(r"Invalid enum value (\S+) for enum type ([\w.]+)")
_MAX_LISTED_VALUES = 32  # an enum's values named in an error


def describe_parse_error(text: str) -> Tuple[Optional[str], str]:
    """(field path, problem) from a json_format.ParseError's message.

    json_format nests its messages, one "Failed to parse F field: " per
    level; the innermost part says what is wrong.
    """
    path: List[str] = []
    rest = text
    while True:
        m = _NESTED.match(rest)
        if not m:
            break
        path.append(m.group(1))
        rest = rest[m.end():]
    unknown = _UNKNOWN.match(rest)
    enum = _ENUM.match(rest)
    if unknown:
        path.append(unknown.group(2))
        problem = "no such field in %s%s" % (unknown.group(1),
                                             _did_you_mean(unknown.group(1), unknown.group(2)))
    elif enum:
        problem = "%s is not one of %s" % (enum.group(1), _enum_values(enum.group(2)))
    else:
        problem = _TRAILER.sub("", rest.splitlines()[0] if rest else rest).rstrip(".")
        if problem.startswith("Failed to load JSON: "):
            problem = "not valid JSON: " + problem[len("Failed to load JSON: "):]
    return (".".join(path) or None), problem or text


def _did_you_mean(message_type: str, name: str) -> str:
    """" (did you mean F?)" for the field of `message_type` nearest `name`."""
    try:
        descriptor = spec_pb2.DESCRIPTOR.pool.FindMessageTypeByName(message_type)
    except KeyError:
        return ""
    fields = [f.name for f in descriptor.fields]
    near = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    return " (did you mean %s?)" % near[0] if near else ""


def _enum_values(enum_type: str) -> str:
    """The values a spec may name for `enum_type` (the _UNSPECIFIED zero left
    out), or the type's name when it is unknown."""
    try:
        descriptor = spec_pb2.DESCRIPTOR.pool.FindEnumTypeByName(enum_type)
    except KeyError:
        return "the values of " + enum_type
    names = [v.name for v in descriptor.values[:_MAX_LISTED_VALUES]
             if not v.name.endswith("_UNSPECIFIED")]
    return ", ".join(names)
