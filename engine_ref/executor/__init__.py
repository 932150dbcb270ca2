"""Executors run the workers: in this process (uni), one process per rank (mp), or Ray actors (ray)."""
