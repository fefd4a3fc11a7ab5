"""What `model=` names, and loading it: built-in, GGUF or Hugging Face folder (`model_source`),
safetensors and GGUF weights sharded per device (`weights`, `gguf_loader`), a GGUF's tokenizer
(`gguf_tokenizer`), and orbax checkpoints in a mesh-independent layout (`checkpoint`)."""
