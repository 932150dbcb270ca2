"""The first module of the chain: harmless itself, it imports the one that touches CUDA."""

from engine_ref_test_plugins.cuda_device import DEVICE  # noqa: F401
