"""OpenAI-compatible server: `python -m dcpjax.serve`."""
