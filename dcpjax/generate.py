"""`python -m dcpjax.generate`: offline generation; the command is `dcpjax.entrypoints.generate`."""

import sys

from dcpjax.entrypoints import cli
from dcpjax.entrypoints.generate import main

if __name__ == "__main__":
    sys.exit(cli.run(main))
