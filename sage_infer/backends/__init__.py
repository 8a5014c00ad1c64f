"""InferenceBackend adapters (native, lmdeploy, vllm), registered lazily in `registry`."""
