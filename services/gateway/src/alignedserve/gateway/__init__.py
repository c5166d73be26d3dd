"""The OpenAI-compatible gateway: HTTP and SSE in, control messages out."""
