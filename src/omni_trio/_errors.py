"""Keep internal exception groups away from users when there is only one error; and
the warning that says what goes in the next version."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["OmniTrioDeprecationWarning", "unwrap_single_exception"]


class OmniTrioDeprecationWarning(FutureWarning):
    """Something you use goes in omni-trio's next version; the message says what
    replaces it. A ``FutureWarning``, as ``trio.TrioDeprecationWarning`` is, so that
    Python shows it by default (a ``DeprecationWarning`` raised inside a library is
    hidden unless you ask for it)."""


def _reraise(exc: BaseException) -> NoReturn:
    """Raise ``exc`` keeping its own ``__context__``.

    Raising a member of a group inside ``except group`` would set the member's
    context to the group that contains it; restore the original instead.
    """
    __tracebackhide__ = True
    context = exc.__context__
    try:
        raise exc
    finally:
        exc.__context__ = context
        del exc, context


@contextmanager
def unwrap_single_exception() -> Iterator[None]:
    """Re-raise the lone member of an exception group raised in the block.

    Our nursery only produces a group when the user's code (or, on a bug, one of our
    tasks) raises; a group of one is that exception, and users should be able to
    ``except ValueError`` around ``async with open_orchestrator(...)`` as usual.
    Groups of several real errors are left intact: hiding one would lose it.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            _reraise(group.exceptions[0])
        raise
