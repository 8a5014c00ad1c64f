"""The `sage` CLI: one module per command group, mounted in `main`."""
