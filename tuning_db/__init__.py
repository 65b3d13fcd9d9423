"""Tuned launch configs per device, and the code that reads them (see the tuner issue)."""
