"""The engine: its flags (`args`: EngineArgs) and configuration (`config`), requests in
(`requests`), continuous batching (`scheduler`, `block_pool`), the loop over the runner (`core`)
and tokens out (`output_processor`)."""
