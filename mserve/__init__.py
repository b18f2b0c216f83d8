"""MServe: disaggregated encode / prefill / decode serving for vision-language models."""
