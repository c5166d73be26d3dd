"""A model's tokenizer without torch, shared by the gateway and the load generator (neither image has torch).

transformers reads a GGUF's tokenizer through a module that imports torch; `gguf.load_gguf_tokenizer` reads
the GGUF metadata itself (`gguf_metadata.read_metadata`), builds the tokenizer with transformers' torch-free
converter and caches it as a plain tokenizer directory under `alignedserve.core.models.cache_root()`.
"""

from __future__ import annotations
