"""What every ``loraledger`` subcommand shares: the application and its global ``-v``, the
``--json`` and log-argument options, ``guarded`` (every failure one ``error:`` line and its exit
code, never a traceback), reading a token from a file or the environment, and the console
script's entry point. The commands are registered on the application by the package's
``__init__.py``, which any import of this module runs first.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import typer
from rich.text import Text

from evlog.errors import LoraLedgerError
from tools import logconfig
from tools.exitcodes import EXIT_HELP, Exit, ToolError
from tools.output import stderr_console

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_PORT = 8765
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"

app = typer.Typer(
    name="loraledger",
    help=(
        "Control plane for versioned LoRA publication to inference fleets: pinned sessions, "
        "safe reclaim, an append-only hash-chained event log.\n\n"
        "Start with [bold]loraledger demo[/], then try replay / audit / verify on the log it "
        "writes."
    ),
    epilog=EXIT_HELP,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_verbosity = 0

JsonOpt = Annotated[
    bool, typer.Option("--json", help="Machine output: JSON (one object per line) on stdout.")
]
LogArg = Annotated[
    str,
    typer.Argument(
        help="The ledger log: a SQLite file written by the ledger, or a postgresql:// URL."
    ),
]


@app.callback()
def _global(
    verbose: Annotated[
        int,
        typer.Option(
            "-v",
            "--verbose",
            count=True,
            help="Show structured logs on stderr: -v each decision, -vv everything.",
        ),
    ] = 0,
) -> None:
    global _verbosity
    _verbosity = verbose
    logconfig.configure(verbose)


def _fail(exc: ToolError) -> typer.Exit:
    """One line on stderr. The message often quotes the user (a path, a name): it is plain
    text, never rich markup (``missing[/x].db`` was a ``MarkupError`` traceback)."""
    where = f" (seq {exc.seq})" if exc.seq is not None else ""
    line = Text.assemble(("error", "bold red"), f"{where}: {exc.message}")
    stderr_console().print(line, highlight=False, soft_wrap=True)
    return typer.Exit(int(exc.exit_code))


def _only(exc: BaseException) -> BaseException:
    """The single error inside (nested) exception groups of one member (an anyio task group
    raising one error), so it is classified like the bare error it is. A group whose errors
    are all the ledger's, with one code, is that error too: a fenced ledger refuses every task
    of a service at once (the reclaimer and the lease expiry both meet ``FENCED``), and that is
    exit 13, not an internal error."""
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
            continue
        _, rest = exc.split(LoraLedgerError)
        if rest is None:  # nothing but ledger errors
            codes = {e.code for e in _leaves(exc) if isinstance(e, LoraLedgerError)}
            if len(codes) == 1:
                return _leaves(exc)[0]
        break
    return exc


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _quiet_stdout() -> None:
    """The reader of stdout went away (``loraledger replay LOG | head``): stop writing there,
    including the interpreter's last flush, which would print its own ``BrokenPipeError``."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # not a real file descriptor (a test runner's buffer)
        pass


def guarded(fn: F) -> F:
    """Turn every failure into one message and its exit code (never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            try:
                result = fn(*args, **kwargs)
                sys.stdout.flush()  # a closed pipe shows here, not in click's exit path
                return result
            except BaseExceptionGroup as group:
                raise _only(group) from None
        except typer.Exit:
            raise
        except BrokenPipeError:  # like a Unix tool killed by SIGPIPE: no message, 128 + 13
            _quiet_stdout()
            raise typer.Exit(int(Exit.BROKEN_PIPE)) from None
        except ToolError as exc:
            raise _fail(exc) from None
        except LoraLedgerError as exc:
            raise _fail(ToolError.from_ledger(exc)) from None
        except KeyboardInterrupt:
            raise typer.Exit(int(Exit.INTERRUPTED)) from None
        except Exception as exc:
            if verbosity() >= 2:
                traceback.print_exc(file=sys.stderr)
            message = f"internal error: {exc!r} (run with -vv for the traceback)"
            raise _fail(ToolError(Exit.FAILED, message)) from None

    return wrapper  # type: ignore[return-value]


def verbosity() -> int:
    """How many ``-v`` the command line gave (read when a command runs, after the callback)."""
    return _verbosity


def run_async(fn: Callable[..., Any], *args: Any) -> Any:
    return anyio.run(fn, *args)


def run_server(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a long-lived server (``serve``, ``gateway``) on uvloop where it is installed (the
    ``fast`` extra), else on asyncio's own loop: every request's scheduling and socket work is
    the loop's, and uvloop's costs less of the process's CPU (BENCHMARKS.md, Gateway). Nothing
    else changes: the code is the same on either loop."""
    return anyio.run(fn, *args, backend_options=server_loop_options())


def server_loop_options(find: Callable[[str], object] = importlib.util.find_spec) -> dict[str, Any]:
    """anyio's asyncio backend options for :func:`run_server`: uvloop when ``find`` finds it."""
    return {"use_uvloop": find("uvloop") is not None}


def secret(
    given: str | None,
    flag: str,
    file: Path | None,
    env_var: str,
    file_flag: str = "--token-file",
) -> str | None:
    """A token from ``file`` (the option ``file_flag``), else ``given`` on the command line
    (warned: ``ps`` shows it to every user of the machine; kept so existing scripts work),
    else ``env_var``."""
    from engines.guard import check_token, read_token

    if given and file is not None:
        raise ToolError(Exit.USAGE, f"give {flag} or {file_flag}, not both")
    try:
        if given:
            stderr_console().print(
                f"warning: {flag} is visible to every user of this machine (ps); "
                f"use {env_var} or {file_flag}",
                markup=False,
            )
            check_token(given, flag)
            return given
        return read_token(env_var, file)
    except (OSError, ValueError) as exc:  # the message never quotes the token
        raise ToolError(
            Exit.USAGE, f"{file_flag}: {exc}" if file is not None else str(exc)
        ) from None


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("PYTHONIOENCODING", "utf-8")
    stdout_before = _identity(1)
    try:
        app()
    except SystemExit as done:
        if done.code == 1 and _stdout_went_away(stdout_before):
            raise SystemExit(int(Exit.BROKEN_PIPE)) from None
        raise


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stdout_went_away(before: tuple[int, int] | None) -> bool:
    """Whether an exit 1 was the answer to a closed stdout outside any command: help is
    printed while click parses the options, before ``guarded`` runs, by a rich console whose
    answer to ``BrokenPipeError`` is to put /dev/null in place of stdout and exit 1. Nothing
    else here swaps stdout for /dev/null (``_quiet_stdout`` does, but exits 141 itself), so
    that mark means the reader went away (``loraledger --help | head -1``): 141, as from a
    command."""
    null = os.stat(os.devnull)
    devnull = (null.st_dev, null.st_ino)
    return before != devnull and _identity(1) == devnull
