"""KV-cache bookkeeping: the pure block allocator and the KV export/import format."""
