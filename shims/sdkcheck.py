"""Checks recorded SDK calls against the installed SDK's own signatures.

A dry run records each call a shim would make (its dotted path in the SDK, positional and keyword
arguments). `check_call` resolves the path in the real package and binds the arguments with
`inspect.signature(...).bind`: a wrong or misspelt argument name, a missing required argument or
one too many is refused with the SDK's own TypeError. Plain values are also checked against plain
annotations (str, int, bool, float, their Optional forms, and sequences and dicts of them), and a
handle from an earlier call must be of the class the parameter names (an Image where the SDK
expects `_Image`)."""
from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from .common import ShimError


@dataclass(frozen=True)
class Ref:
    """What a recorded call returned: `kind` is the SDK class (Image, Secret, Sandbox, ...)."""
    kind: str
    id: str

    def __repr__(self) -> str:
        return f"<{self.id}>"


@dataclass
class Call:
    path: str                   # "Sandbox.create", or "Sandbox.tunnels" for a method
    args: tuple
    kwargs: dict
    result: Ref | None = None
    on: Ref | None = None       # the instance, for a method call
    redact: set = field(default_factory=set)   # keys of dict arguments to print as <redacted>


def resolve(module: Any, path: str) -> Any:
    obj = module
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ShimError(f"{path}: {module.__name__} {getattr(module, '__version__', '')} has no such attribute")
        obj = getattr(obj, part)
    return obj


def _fits(annotation: Any, value: Any) -> bool:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    if isinstance(value, Ref):
        # A handle fits a parameter whose annotation names its class (modal's `_Image`,
        # `_Secret`, ...), or any annotation that is not a plain value type.
        text = str(annotation)
        if isinstance(annotation, type) and annotation in (str, int, float, bool, dict, list):
            return False
        return value.kind in text or f"_{value.kind}" in text or "Any" in text
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(a, value) for a in args)
    if origin is typing.Literal:
        return value in args
    if annotation is type(None):
        return value is None
    if annotation in (str, bool):
        return type(value) is annotation
    if annotation is int:
        return type(value) is int
    if annotation is float:
        return type(value) in (int, float)
    if origin in (list, collections.abc.Sequence, collections.abc.Collection, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        inner = args[0] if args else Any
        return all(_fits(inner, v) for v in value)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, dict):
            return False
        if not args:
            return True
        return all(_fits(args[0], k) and _fits(args[1], v) for k, v in value.items())
    # Types this check does not model (os.PathLike, protobuf enums, ...): left to the SDK.
    return True


def check_call(module: Any, call: Call) -> None:
    """Raises ShimError naming the call and the argument when the SDK would refuse it."""
    fn = resolve(module, call.path)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ShimError(f"{call.path}: no signature to check against: {e}") from None
    args = ((call.on,) if call.on is not None else ()) + tuple(call.args)
    try:
        bound = sig.bind(*args, **call.kwargs)
    except TypeError as e:
        raise ShimError(f"{call.path}: {e}") from None
    for name, value in bound.arguments.items():
        p = sig.parameters[name]
        if call.on is not None and name == next(iter(sig.parameters)):
            continue
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            values = value
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        else:
            values = (value,)
        for v in values:
            if not _fits(p.annotation, v):
                raise ShimError(f"{call.path}: argument {name}={v!r} does not fit {p.annotation}")


def redacted(value: Any, keys: set) -> Any:
    if isinstance(value, dict):
        return {k: ("<redacted>" if k in keys else redacted(v, keys)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(v, keys) for v in value]
    if isinstance(value, Ref):
        return {"$ref": value.id}
    return value


def call_json(call: Call) -> dict:
    d: dict[str, Any] = {"call": call.path}
    if call.on is not None:
        d["on"] = {"$ref": call.on.id}
    d["args"] = redacted(list(call.args), call.redact)
    d["kwargs"] = redacted(call.kwargs, call.redact)
    if call.result is not None:
        d["returns"] = call.result.id
    return d


def _unref(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$ref"}:
            kind = value["$ref"].split("#")[0]
            return Ref(kind[:1].upper() + kind[1:], value["$ref"])
        return {k: _unref(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unref(v) for v in value]
    return value


def call_from_json(d: dict) -> Call:
    """The inverse of call_json: a printed call, ready for check_call again."""
    on = _unref(d["on"]) if "on" in d else None
    return Call(d["call"], tuple(_unref(d["args"])), _unref(d["kwargs"]), on=on)
