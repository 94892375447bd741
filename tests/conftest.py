import os

from hypothesis import settings

pytest_plugins = ["verl_tide.testing.pytest_plugin"]

# CI runs the same examples every time (reproducible verdicts); local runs keep exploring.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
