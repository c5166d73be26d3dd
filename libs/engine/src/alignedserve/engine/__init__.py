"""Model side of the prefill and decode workers: loading, paged KV, batched prefill/decode, sampling."""
