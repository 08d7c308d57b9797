"""Built-in jobs: demos and tests that need nothing downloaded."""
