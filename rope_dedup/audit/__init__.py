"""The audit: which RoPE each layer holds or applies, judged against what was intended (``explain``)."""
