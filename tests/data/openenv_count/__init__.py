"""A small environment written for OpenEnv (openenv-core 0.3.0's own base classes), as a user's would be: say digits
until the total reaches exactly 10. Imported only inside the OpenEnv virtual environment (.venv-openenv)."""
