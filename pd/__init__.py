"""pd: a prefill/decode disaggregated LLM server."""
