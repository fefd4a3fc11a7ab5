"""Planning a deployment before anything runs (`python -m dcpjax.plan`): a deployment file's memory
plan (`deployment`), every DCP size of a model compared with its traffic, roofline and a
recommendation (`planner`), and the example deployments shipped with the package
(`deployments`). The command is `command` (`dcpjax.plan.main(argv)`, as in a notebook)."""

from dcpjax.plan.command import build_parser, main

__all__ = ["build_parser", "main"]
