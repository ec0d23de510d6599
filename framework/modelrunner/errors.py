"""The kernel's exceptions: each says what was wrong and what would be accepted."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: object, known: Iterable[str], n: int = 1) -> str:
    """``"; did you mean 'x'?"`` (``n`` > 1: ``"; close matches: x, y"``) for the entries of ``known``
    closest to ``name``, or ``""`` when none is close: the hint every "unknown name" error carries."""
    close = difflib.get_close_matches(str(name), sorted(known), n=n)
    if not close:
        return ""
    return f"; did you mean {close[0]!r}?" if n == 1 else f"; close matches: {', '.join(close)}"


class ModelRunnerError(Exception):
    """Base class of every error modelrunner raises on purpose."""


class PluginError(ModelRunnerError):
    """A plugin could not be loaded or broke the hook contract (e.g. a misspelled hook)."""


class UnknownNameError(ModelRunnerError, ValueError):
    """A name (architecture, allocator, compile backend) that no installed plugin provides."""


class PluginConflictError(ModelRunnerError, ValueError):
    """Several installed plugins provide one name and the configuration does not say which to use."""


class ModelSourceError(ModelRunnerError, ValueError):
    """The ``model`` given cannot be resolved to a local checkpoint."""


class StructuredOutputError(ModelRunnerError, ValueError):
    """A structured-output constraint that cannot be served: malformed parameters (no or several
    constraint kinds, a schema that is not a JSON object, an invalid regex, an empty choice list) or
    a feature the grammar backend does not support. The message names the bad value or the feature
    and what is accepted; a server answers 400.

    :param feature: what was refused (``"regex"``, ``"json schema keyword 'multipleOf'"``, ...).
    :param backend: the grammar backend that refused it (None: refused before a backend saw it).
    """

    def __init__(self, message: str, *, feature: str | None = None, backend: str | None = None) -> None:
        super().__init__(message)
        self.feature = feature
        """What was refused."""
        self.backend = backend
        """The grammar backend that refused it, if one did."""

    def with_prefix(self, prefix: str) -> StructuredOutputError:
        """The same error with ``prefix`` before its message (``"prompt 3: "``)."""
        return StructuredOutputError(prefix + str(self), feature=self.feature, backend=self.backend)


class FatalError(ModelRunnerError):
    """An error after which the runner cannot serve any request (e.g. a parallel worker died).

    The engine re-raises it instead of failing one request at a time.
    """


class PluginWarning(UserWarning):
    """Something about the installed plugins that changes what runs (e.g. a broken native adapter
    sends its architecture to the slow generic fallback)."""


DEBUG_ENV = "MODELRUNNER_DEBUG"
"""Set (to anything) to print the traceback behind a one-line error."""


def error_line(error: BaseException, hint: bool = True) -> str:
    """The one-line form of an error the CLI, the server and the bench workers print: its message for
    the errors modelrunner raises on purpose (and ``ValueError`` / ``OSError``), prefixed with the type
    name for anything else (with ``hint``, followed by how to see the traceback)."""
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, (ModelRunnerError, ValueError, OSError)):
        return message
    return f"{type(error).__name__}: {message}" + (f" (unexpected; {DEBUG_ENV}=1 shows the traceback)" if hint else "")

