pytest_plugins = ["verl_tide.testing.pytest_plugin"]
