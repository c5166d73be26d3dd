"""`alignedserve bench accuracy`: the reduced-precision accuracy contract (contract.py)."""
