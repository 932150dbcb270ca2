"""A native extension crashing at import, as a broken kernel build does."""

import os
import signal

os.kill(os.getpid(), signal.SIGSEGV)
