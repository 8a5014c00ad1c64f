"""The prefill/decode router (`sage llm serve --pd xPyD`)."""
