"""The decode worker: an engine holding imported requests, driven by the per-iteration scheduler."""
