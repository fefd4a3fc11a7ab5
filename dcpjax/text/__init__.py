"""Text in and out: tokenizers (`tokenizer`: bytes for the tiny models, Hugging Face tokenizers) and
chat templates rendered as transformers renders them (`chat_template`)."""
