"""OpenAI-compatible HTTP server and Prometheus metrics over the native engine."""
