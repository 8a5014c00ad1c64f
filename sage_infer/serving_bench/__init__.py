"""Client side of the serving benchmark (`sage llm bench`).

``workloads`` and ``trace`` build token-id prompts grouped into conversations, ``client``
streams them to an OpenAI-compatible server and times every SSE chunk, ``stats`` turns
the measurements into percentiles and rates, ``report`` shows them. Only ``client``
needs httpx; nothing here is imported by ``import sage_infer``.
"""
