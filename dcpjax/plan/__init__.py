"""Planning a deployment before anything runs (`python -m dcpjax.plan`): a deployment file's memory
plan (`deployment`), every DCP size of a model compared with its traffic, roofline and a
recommendation (`planner`), and the example deployments shipped with the package
(`deployments`). The command itself is `__main__`."""
