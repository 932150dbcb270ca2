"""The engine core: startup phases, scheduling, the startup report."""
