"""`python -m dcpjax COMMAND ...`: one entry point for every command.

`python -m dcpjax serve ARGS` runs the same `main` as `python -m dcpjax.serve ARGS`, with the
same exit status (and likewise for the others); `python -m dcpjax` alone lists them. A
command's module is imported only when it runs, so this costs no more than `import dcpjax`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from dcpjax.entrypoints import cli

# command -> (module whose `main(argv)` runs it, what it does)
COMMANDS = {
    "generate": ("dcpjax.entrypoints.generate", "generate from prompts (and compare with DCP 1): the offline LLM"),
    "serve": ("dcpjax.serve.__main__", "an OpenAI-compatible HTTP server (vLLM's flags)"),
    "bench": ("dcpjax.bench.__main__", "benchmarks: offline throughput, a running server, DCP 1 vs DCP k"),
    "plan": ("dcpjax.plan.command",
             "the memory plan of a deployment file, or every DCP size of --model compared (nothing runs)"),
    "demo": ("dcpjax.demo.__main__",
             "one layer's DCP decode attention at DCP 1/2/4/8 against no DCP, on fake CPU devices"),
}


def usage() -> str:
    """The list of commands, one line each, and how to get their help."""
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m dcpjax COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "python -m dcpjax COMMAND --help (or python -m dcpjax.COMMAND --help) shows a command's flags."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run COMMAND's own `main` with the rest of `argv`; no command (or -h): the list of commands."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] not in COMMANDS:
        print(f"error: unknown command {args[0]!r}: one of {', '.join(COMMANDS)} (python -m dcpjax lists them)",
              file=sys.stderr)
        return cli.USAGE_EXIT
    command = importlib.import_module(COMMANDS[args[0]][0])
    return cli.run(command.main, args[1:])


if __name__ == "__main__":
    sys.exit(main())
