"""Waits forever at import (a lock, a network call, a device that never answers)."""

import time


def wait_for_device() -> None:
    time.sleep(600)


wait_for_device()
