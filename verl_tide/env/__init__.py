"""Environment service: protocol `tide-env/1`, async client, reference server, built-in environments,
conformance kit, and a verl agent loop that drives an environment through the client."""
