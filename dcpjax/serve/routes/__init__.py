"""The HTTP endpoints, one module per family (`completions`, `chat_completions`, `tokenization`),
and what only they use: logprob formatting, the OpenAPI document."""
