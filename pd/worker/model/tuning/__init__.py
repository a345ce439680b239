"""What `--dtype auto` / `--quantization auto` resolve to on a CPU, and the judges that accept a
format: the decision rule (autotune.py), the timing (kernel_search.py), the cache
(kernel_cache.py), the worker's entry point (kernel_choice.py), the perplexity bound
(perplexity.py) and the row-invariance check (row_invariance.py)."""
