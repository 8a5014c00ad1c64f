"""sage_infer inside other engines: the vLLM KV connector (`integrations.vllm`).

Nothing here is imported by `import sage_infer`; each integration imports its engine lazily.
"""
