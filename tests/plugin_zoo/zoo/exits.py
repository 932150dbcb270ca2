"""Native code calling exit() at import (a kernel library that finds no device)."""

import os

os._exit(3)
