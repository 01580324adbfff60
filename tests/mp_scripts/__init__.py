"""Scripts that the multi-process tests run as separate processes, and helpers to start them."""
