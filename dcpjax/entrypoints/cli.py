"""What every `python -m dcpjax...` command shares: user errors as one line, tracebacks for bugs.

A mistake the user can fix (a bad flag value, a model that is not there, too few devices, a
server that does not answer) prints `error: <what> — <how to fix>` on stderr and exits 2, as
argparse does for a bad flag. Anything else is a bug and keeps its traceback; `--debug` (or
DCPJAX_DEBUG=1) shows the traceback of a user error too.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

USAGE_EXIT = 2  # argparse's status for a bad command line

# What dcpjax raises for input it cannot use (ValueError, with the fix in its message) and what the
# system says about files, sockets and servers (OSError: FileNotFoundError, ConnectionRefusedError,
# urllib's URLError, "address already in use").
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose command-line error is two short lines, not the whole usage first:
    the error, with "did you mean" for a misspelled flag, then where the flags are listed."""

    def error(self, message: str) -> NoReturn:
        hint = _did_you_mean(message, _flags(self))
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message}{hint}\n{self.prog}: see --help for every flag\n")


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of `parser` and its subcommands (an unknown flag after a subcommand is reported
    by the top parser)."""
    flags = []
    for action in parser._actions:
        flags += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            flags += [f for sub in action.choices.values() for f in _flags(sub)]
    return list(dict.fromkeys(flags))


def _did_you_mean(message: str, flags: list[str]) -> str:
    """" (did you mean --x?)" for each unrecognized flag in argparse's `message` that is near a real one."""
    if not message.startswith("unrecognized arguments: "):
        return ""
    guesses = []
    for word in message.removeprefix("unrecognized arguments: ").split():
        flag = word.split("=", 1)[0]
        if flag.startswith("-") and (close := difflib.get_close_matches(flag, flags, n=1, cutoff=0.7)):
            guesses.append((flag, close[0]))
    if len(guesses) == 1:
        return f" (did you mean {guesses[0][1]}?)"
    return f" ({'; '.join(f'{flag}: did you mean {close}?' for flag, close in guesses)})" if guesses else ""


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """`--debug`: a user error prints its traceback too (for bug reports)."""
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error, not one line")


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    """An optional positional MODEL, the same as --model (vLLM's `vllm serve MODEL`); read it
    back with `parse_with_model`."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model takes it")


def parse_with_model(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv`; a positional MODEL becomes `args.model` (a different --model too: a usage error)."""
    # model=None up front: argparse then leaves it None unless --model is given, so "given" is knowable
    args = parser.parse_args(argv, argparse.Namespace(model=None))
    tag = vars(args).pop("model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        parser.error(f"MODEL {tag!r} and --model {args.model!r} differ: give the model once")
    args.model = tag or args.model or parser.get_default("model")
    return args


def configure_logging() -> None:
    """dcpjax's INFO lines on stderr; JAX's only from WARNING (its INFO is the backends it probed
    and did not find, e.g. "Unable to initialize backend 'tpu'": no news, and it would break a
    one-line error in two)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)


def _raised(err: BaseException, module: str, name: str) -> bool:
    """Whether `err` is a `module.name` (e.g. the engine's ConfigurationError), asked without
    importing `module`: only a module already imported can have raised one, and importing the
    engine just to ask would load JAX into commands that need none (the router)."""
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(err, cls)


def user_message(err: BaseException) -> str:
    """One line saying what is wrong and how to fix it."""
    if _raised(err, "dcpjax.engine.preflight", "ConfigurationError"):
        needed = err.devices[0] if err.devices else 0
        return err.message(device_fix=f"on CPU pass --num-cpu-devices {needed} (fake CPU devices), or lower "
                                      "--tensor-parallel-size")
    if _raised(err, "dcpjax.sharding.config", "TooFewDevicesError"):
        return (f"tensor_parallel_size={err.needed} needs {err.needed} devices but {err.visible} are visible — on "
                f"CPU pass --num-cpu-devices {err.needed} (fake CPU devices), or lower --tensor-parallel-size")
    if getattr(err, "summary", ""):  # an error whose message carries more (a server's log tail)
        return " ".join(err.summary.split())
    reason = getattr(err, "reason", None)  # urllib's URLError wraps the socket's error
    text = str(reason if isinstance(reason, BaseException) else err) or type(err).__name__
    if isinstance(err, FileNotFoundError) and err.filename is not None:
        text = f"no such file or folder: {err.filename} — check the path"
    elif isinstance(err, ConnectionError) or isinstance(reason, ConnectionError):
        text = f"cannot connect ({text}) — is the server running, at this --host / --port or --base-url?"
    return " ".join(text.split())


def run(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Call `main(argv)`; a user error becomes one line on stderr and exit status 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("DCPJAX_DEBUG", "") not in ("", "0")
    try:
        return main(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if debug:
            raise
        sys.stdout.flush()
        print(f"error: {user_message(err)}", file=sys.stderr)
        return USAGE_EXIT
