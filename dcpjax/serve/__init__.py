"""OpenAI-compatible server: `python -m dcpjax.serve`.

The app (`api.build_app`) and what its parts share sit here (`context`, `async_engine`,
`protocol`, `errors`, `metrics`, `request_log`); the endpoints are in `routes`, tool calling
in `tools`, and process control (launch, several processes, faults, shutdown) in `process`.
"""
