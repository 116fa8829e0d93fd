"""Storage faults: which errors mean damaged or unwritable files, what they name, and keeping them quiet.

Orbax and TensorStore report a damaged file in many ways: a bare ``Exception``
wrapping TensorStore's ``ValueError("OUT_OF_RANGE: ...")``, a
``json.JSONDecodeError``, an ``OSError``, sometimes an exception group from
its asyncio tasks. These helpers decide from the whole chain whether an error
is one of those (and so a damaged checkpoint or a failed write), never from
its type alone: a ``TypeError`` raised by a bug keeps its own type.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import json
import logging
import re
import sys
import threading
import traceback
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from nnx_shard.errors import NnxShardError

logger = logging.getLogger(__name__)

# TensorStore errors carry an absl status code first: "OUT_OF_RANGE: Error reading ...".
_STATUS = re.compile(
    r"^(DATA_LOSS|NOT_FOUND|OUT_OF_RANGE|FAILED_PRECONDITION|INVALID_ARGUMENT|UNKNOWN|INTERNAL|"
    r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|UNAVAILABLE|ABORTED|ALREADY_EXISTS):"
)
# Orbax's own wording for a read or a metadata file that failed.
_ORBAX_READ = re.compile(
    r"Encountered error while reading|Failed to (?:read|restore|load)|does not exist|"
    r"No such file|not a valid checkpoint|Unexpected end|Unable to (?:open|read)|"
    r"Error opening|Metadata file .* (?:not|missing)|Could not (?:read|find)|is not a directory"
)
_DECODE = (json.JSONDecodeError, UnicodeDecodeError, zlib.error, EOFError)
_ARRAY = re.compile(r'(?:reading|writing) "([^"]+?)(?:\.value)?/[\d.]*"')
_FILE = re.compile(r"""(?:local file |'path': |file ")["']?(/[^"'\s,]+)""")
_QUIET = ("absl", "orbax", "asyncio", "tensorstore", "etils")
_QUIETING = threading.local()  # this thread's open quiet() blocks: a restore's reads share one collection


def chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and everything it wraps: causes, contexts and the members of exception groups."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)


class StorageAction(enum.Enum):
    """What a storage fault interrupted: it decides which error reports it."""

    SAVING = "saving"
    SETTING_ASIDE = "setting aside"


def is_storage_error(error: BaseException) -> bool:
    """Whether ``error`` comes from reading or writing files: I/O, decoding, TensorStore or Orbax reads.

    >>> is_storage_error(ValueError("OUT_OF_RANGE: Error reading ..."))
    True
    >>> is_storage_error(TypeError("Type mismatch at key path"))
    False
    """
    for e in chain(error):
        if isinstance(e, (OSError, *_DECODE)):
            return True
        if isinstance(e, ValueError) and _STATUS.match(str(e)):
            return True
        if type(e) in (Exception, ValueError, FileNotFoundError, KeyError) and _ORBAX_READ.search(str(e)):
            return True
    return False


def os_error(error: BaseException) -> OSError | None:
    """The first OSError in ``error``'s chain (a full disk, a permission problem), if any."""
    return next((e for e in chain(error) if isinstance(e, OSError)), None)


_OS_CODE = re.compile(r":\s*([^:\[]+?)\s*\[os_error_code='?(\d+)'?\]")


def os_reason(error: BaseException) -> str | None:
    """The operating system's reason in a chain: an OSError's, or the one TensorStore quotes (``File too
    large``).

    >>> message = "OUT_OF_RANGE: Failed to write 10 bytes to file 8: File too large [os_error_code='27']"
    >>> os_reason(ValueError(message))
    'File too large (errno 27)'
    """
    for e in chain(error):
        if isinstance(e, OSError) and e.strerror:
            return f"{e.strerror} (errno {e.errno})" + (f": {e.filename}" if e.filename else "")
        m = _OS_CODE.search(str(e))
        if m:
            return f"{m.group(1).strip()} (errno {m.group(2)})"
    return None


def describe(error: BaseException) -> str:
    """The most specific line of the chain: TensorStore's status line, else the first line of the error."""
    best = None
    for e in chain(error):
        text = str(e).strip()
        if isinstance(e, ValueError) and _STATUS.match(text):
            return text.splitlines()[0][:400]
        if best is None and text:
            best = f"{type(e).__name__}: {text.splitlines()[0][:300]}"
    return best or type(error).__name__


def named(error: BaseException) -> tuple[list[str], list[str]]:
    """The arrays (``model/l1/kernel``) and the files an error chain names."""
    arrays: list[str] = []
    files: list[str] = []
    for e in chain(error):
        text = str(e)
        for m in _ARRAY.finditer(text):
            name = m.group(1).replace(".", "/")
            if name not in arrays:
                arrays.append(name)
        for m in _FILE.finditer(text):
            if m.group(1) not in files:
                files.append(m.group(1))
        filename = getattr(e, "filename", None)
        if isinstance(e, OSError) and filename and str(filename) not in files:
            files.append(str(filename))
    return arrays, files


@contextlib.contextmanager
def quiet() -> Iterator[list[str]]:
    """Silences the dependencies' loggers and unraisable-exception reports for the duration.

    A damaged file makes Orbax's reader coroutines fail one by one, and each one left unawaited is printed
    by ``sys.unraisablehook`` with its whole TensorStore spec; their first lines are collected into the
    yielded list instead, for the error's detail. Blocks nest: the outermost one collects the garbage once,
    when an error passed through any of them (a successful read leaves no coroutine unawaited).
    """
    hidden: list[str] = []
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in _QUIET]
    previous = sys.unraisablehook

    def collect(unraisable: Any) -> None:
        value = unraisable.exc_value
        if value is not None and len(hidden) < 20:
            hidden.append(f"{type(value).__name__}: {str(value).splitlines()[0][:200] if str(value) else ''}")

    for dependency, _ in saved:
        dependency.setLevel(logging.CRITICAL)
    sys.unraisablehook = collect
    depth = getattr(_QUIETING, "depth", 0)
    _QUIETING.depth = depth + 1
    if depth == 0:
        _QUIETING.failed = False
    error: BaseException | None = None
    try:
        yield hidden
    except BaseException as e:  # seen by every block it passes, even when an outer one's body handles it
        _QUIETING.failed, error = True, e
        raise
    finally:
        _QUIETING.depth = depth
        if depth == 0 and _QUIETING.failed:  # the outermost block, after a failure inside: one collection
            # A failed read's unawaited coroutines are reported when collected: inside, not after. The
            # frames the error's tracebacks went through still hold some of them (asyncio's gather), so
            # their locals go first; the error keeps its messages and the lines it passed.
            for e in chain(error) if error is not None else ():
                traceback.clear_frames(e.__traceback__)
            gc.collect()
        sys.unraisablehook = previous
        if depth == 0 and _QUIETING.failed:
            _filter_abandoned_reads()
        for dependency, level in saved:
            dependency.setLevel(level)


def _abandoned_read(unraisable: Any) -> bool:
    """Whether ``unraisable`` is a TensorStore callback of a read that a failed restore abandoned: it came
    back after Orbax had closed that read's event loop (``RuntimeError: Event loop is closed``, raised in
    asyncio's ``_check_closed``, reported with no object)."""
    value, tb = unraisable.exc_value, unraisable.exc_traceback
    if unraisable.object is not None or not isinstance(value, RuntimeError) or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return (
        str(value) == "Event loop is closed"
        and code.co_name == "_check_closed"
        and "asyncio" in code.co_filename
    )


def _filter_abandoned_reads() -> None:
    """After a failed read: from now on, the late callbacks of its abandoned reads (:func:`_abandoned_read`)
    are logged at debug level instead of printed as tracebacks, whenever they come back (a read in flight
    can finish after the error was raised, even at exit). Any other unraisable goes to the hook in place."""
    current = sys.unraisablehook
    if getattr(current, "_nnx_shard_filter", False):
        return

    def hook(unraisable: Any) -> None:
        if _abandoned_read(unraisable):
            logger.debug("a read abandoned by a failed restore came back after its event loop closed")
            return
        current(unraisable)

    hook._nnx_shard_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


@contextlib.contextmanager
def storage_faults(convert: Callable[[BaseException, list[str]], BaseException]) -> Iterator[list[str]]:
    """Quiet (:func:`quiet`), and a storage fault raised inside re-raised as ``convert(error, hidden)``.

    Orbax raises a bare ``Exception`` for a failed read, wrapping TensorStore's
    error, so no narrower class catches it: the whole chain decides
    (:func:`is_storage_error`). Anything else, and every error of ours,
    propagates as itself.
    """
    with quiet() as hidden:
        try:
            yield hidden
        except NnxShardError:
            raise
        except Exception as e:  # filtered: only storage faults are converted
            if not is_storage_error(e):
                raise
            raise convert(e, hidden) from e
