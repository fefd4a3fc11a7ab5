"""Prefill/decode disaggregation: a sequence's KV moved between two engines with their own layouts."""
