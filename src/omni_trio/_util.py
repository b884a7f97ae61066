"""Foundations every wing of omni_trio stands on: no trio, no asyncio, no orchestrator.

A worker process imports this module and little else of ours, so it must stay small
and free of the orchestrator's modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from types import FunctionType
from typing import Any, NoReturn, TypeVar

__all__ = [
    "LARGE_BUFFER",
    "SIZELESS_TYPES",
    "NoPublicConstructor",
    "describe",
    "final",
    "import_object",
    "lazy_exports",
    "output_size",
    "return_large_buffers",
    "stage_label",
]

T = TypeVar("T")


#: Types whose data counts 0 bytes (:func:`output_size`), checked before any isinstance.
SIZELESS_TYPES = frozenset({type(None), int, float, bool, list, tuple, dict})


def output_size(data: object) -> int:
    """The bytes an output's ``data`` counts for flow control: the length of
    ``bytes``, ``bytearray`` and ``str`` (and their subclasses), a ``memoryview``'s
    ``nbytes``; 0 for anything else (which counts as one output all the same).

    The orchestrator and a worker count with this one function, so a worker's credit
    and the orchestrator's ledger agree to the byte.
    """
    kind = type(data)
    if kind is bytes or kind is str or kind is bytearray:
        return len(data)  # type: ignore[arg-type]
    if kind in SIZELESS_TYPES:  # the other common payloads: no isinstance walk
        return 0
    if kind is memoryview:
        return data.nbytes  # type: ignore[attr-defined, no-any-return]
    if isinstance(data, (bytes, bytearray, str)):
        return len(data)
    if isinstance(data, memoryview):
        return data.nbytes
    return 0


def stage_label(stage_id: int, name: object = None) -> str:
    """How messages name a stage: ``stage 0 (thinker)``, or ``stage 0`` when it has no
    name (or its name only repeats its index, as the default ``stage0`` does)."""
    if isinstance(name, str) and name and name != f"stage{stage_id}":
        return f"stage {stage_id} ({name})"
    return f"stage {stage_id}"


def describe(exc: BaseException) -> str:
    """``"ValueError: the message"``, or the bare type name when there is no message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def import_object(path: str) -> Any:
    """``"package.module:name"`` -> the object (``name`` may be dotted).

    Raises:
      ValueError: ``path`` is not of that form.
      ImportError, AttributeError: what importing it raised.
    """
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"{path!r} is not an import path of the form 'package.module:name'")
    target: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        target = getattr(target, attr)
    return target


# -- class conventions (as trio's own ``trio._util``) -------------------------------------


def _no_subclasses(cls: type) -> NoReturn:
    raise TypeError(f"{cls.__module__}.{cls.__qualname__} does not support subclassing")


def final(cls: type[T]) -> type[T]:
    """Mark a class final: type checkers refuse subclasses, and so does the runtime."""
    cls.__init_subclass__ = classmethod(_no_subclasses)  # type: ignore[assignment]
    return typing.final(cls)


class NoPublicConstructor(type):
    """A metaclass for classes users get from a factory and never build themselves.

    ``SomeClass(...)`` raises ``TypeError``; the package calls ``SomeClass._create(...)``.
    """

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} has no public constructor")

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        return super().__call__(*args, **kwargs)  # type: ignore[misc, no-any-return]


# -- public namespaces --------------------------------------------------------------------


def _ours(value: object, namespace: str, module: str) -> bool:
    """A class or function defined in a submodule of ``namespace``, or in ``module``,
    which the namespace exports it from (not a type alias such as ``Callable[...]``,
    which on 3.10 passes for a class)."""
    return (
        isinstance(value, (type, FunctionType))
        and not hasattr(value, "__origin__")
        and (value.__module__ == module or value.__module__.startswith(f"{namespace}."))
    )


def lazy_exports(
    namespace: str,
    exports: Mapping[str, Iterable[str]],
    moved: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a package that re-exports names on demand.

    ``exports`` maps a submodule (relative, like ``"._core"``) to the public names it
    defines. A name's module is imported the first time the name is asked for, so a
    process that needs one corner of the package -- a stage worker, whose engine asks
    ``omni_trio.process`` for ``EngineRequest`` -- does not load the rest. Every public
    object of a loaded module reports the namespace as its ``__module__`` (reprs and
    docs say ``omni_trio.process.ProcessStage``, not ``omni_trio.process._stage...``),
    including modules that were loaded some other way before the first lookup.

    ``moved`` maps a name that lived here once to the namespace it lives in now: it is
    still found here for one version, with an
    :class:`~omni_trio.OmniTrioDeprecationWarning` naming its new home, and is in
    neither ``__all__`` nor ``dir()``.
    """
    modules = {importlib.util.resolve_name(m, namespace): list(n) for m, n in exports.items()}
    where = {name: module for module, names in modules.items() for name in names}

    def publish() -> dict[str, Any]:
        package = vars(sys.modules[namespace])
        for module, names in modules.items():
            source = sys.modules.get(module)
            if source is None or names[0] in package:
                continue  # not loaded yet, or published already
            for name in names:
                value = getattr(source, name)
                if _ours(value, namespace, module):
                    value.__module__ = namespace
                package[name] = value  # from now on found without __getattr__
        return package

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            home = (moved or {}).get(name)
            if home is None:
                raise AttributeError(f"module {namespace!r} has no attribute {name!r}")
            import warnings

            from ._errors import OmniTrioDeprecationWarning

            warnings.warn(
                f"{namespace}.{name} goes in omni-trio's next version: import it from {home}",
                OmniTrioDeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(home), name)
        importlib.import_module(module)
        return publish()[name]

    def __dir__() -> list[str]:
        for module in modules:
            importlib.import_module(module)
        return sorted(publish())

    return __getattr__, __dir__


#: Allocations of this many bytes or more go back to the system once freed, in a
#: process that called :func:`return_large_buffers`. Above the bench's 1 MB chunks
#: (their frames are a few bytes over 1 MiB): at 1 MiB, each such hop paid for the
#: ``mmap`` and first touch of every buffer it went through, and ran at 0.3x.
LARGE_BUFFER = 2 << 20
_M_TRIM_THRESHOLD = -1  # mallopt's parameters, in glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def return_large_buffers(threshold: int = LARGE_BUFFER) -> bool:
    """Pin glibc's ``malloc`` mmap threshold at ``threshold`` bytes in this process,
    and its trim threshold at twice that; return whether it did (``False`` on another
    C library, left alone).

    glibc serves an allocation of the threshold or more (128 KiB at first) with an
    ``mmap`` of its own, which ``free`` hands back to the system. But each time it
    frees one, it raises the threshold to that one's size (up to 32 MiB), and from
    then on buffers that large come from its heap, whose free space it keeps: a
    process that handled a few multi-megabyte outputs at once (a server whose stalled
    requests each hold one, a worker that encoded several) keeps that much RSS long
    after they were freed. Pinned (which turns the raising off), a buffer of
    ``threshold`` bytes or more always comes from ``mmap`` and goes back when freed,
    at the cost of an ``mmap`` and its pages' first touch; smaller ones come from the
    heap, as before. The trim threshold is what glibc's raising would have set with
    it (twice the mmap threshold): left at its 128 KiB, every free at the heap's top
    handed pages back that the next buffer faulted in again (48 KB chunks between
    workers ran at 0.6x). ``omni-trio serve`` and the worker processes pin both.
    """
    import ctypes

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):  # no such name, no glibc, no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2 * threshold)
    )
