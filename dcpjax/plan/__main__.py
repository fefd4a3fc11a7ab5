"""`python -m dcpjax.plan`: the command is `dcpjax.plan.command`."""

import sys

from dcpjax.entrypoints import cli
from dcpjax.plan.command import main

if __name__ == "__main__":
    sys.exit(cli.run(main))
