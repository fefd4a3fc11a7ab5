"""The command lines: what every command shares (`cli`: one-line user errors, --debug) and offline
generation (`generate`, run as `python -m dcpjax.generate`). The other commands live with their
layer: `serve`, `bench`, `plan` and `demo` are packages with a `__main__`."""
