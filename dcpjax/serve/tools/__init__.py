"""Tool calling: the server's flags and the chat glue (`calls`), vLLM's parsers (`parsers`), and
the pure-Python streaming reader (`streaming`, `json_writer`) behind them."""
