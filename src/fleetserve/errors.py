"""User-facing errors.

Every error a user can cause (a bad trace, an unknown model name, a config that
cannot fit) is raised as a :class:`FleetserveError` subclass whose message is one
readable line naming the file, line or field and what was expected. The CLI
prints that line and exits with status 2; it never shows a traceback for these.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FleetserveError(Exception):
    """Base class of every error caused by user input or configuration."""


class InputError(FleetserveError):
    """Bad input data: a trace, a profile CSV, a YAML config.

    Args:
        message: what was wrong and what was expected.
        file: the file it came from, if any.
        line: 1-based line number in ``file``, if known.
        field: the column, key or field name, if known.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.file = file
        self.line = line
        self.field = field
        self.detail = message
        where = []
        if file is not None:
            where.append(f"{file}:{line}" if line is not None else file)
        if field is not None:
            where.append(f"field '{field}'")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class ConfigError(FleetserveError):
    """A configuration that is invalid or cannot run (e.g. a model that does not fit)."""


class UnknownNameError(FleetserveError):
    """An unknown catalog or registry name; the message suggests the closest known ones.

    Args:
        kind: what was looked up (``stack``, ``dispatch policy``, ...).
        name: the name given.
        known: the names that exist.
        note: an extra remark ending the message (e.g. where the name does exist).
    """

    def __init__(self, kind: str, name: str, known: Iterable[str], note: str = "") -> None:
        known_list = sorted(known)
        close = difflib.get_close_matches(name.lower(), known_list, n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        tail = f" ({note})" if note else ""
        super().__init__(f"unknown {kind} {name!r}.{hint} Known: {', '.join(known_list)}{tail}")
        self.kind = kind
        self.name = name


def require_modules(command: str, extra: str, *modules: str) -> None:
    """Raise a one-line error when ``command`` needs a module that is not installed.

    Args:
        command: the CLI command, for the message.
        extra: the ``fleetserve[...]`` extra that installs the modules.
        modules: import names to look for.
    """
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise FleetserveError(
            f"{command} needs {', '.join(missing)}, which is not installed; "
            f"install the {extra} extra: pip install 'fleetserve[{extra}]'"
        )
