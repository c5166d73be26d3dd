"""`alignedserve up`: the whole stack on one machine, one process per service."""
