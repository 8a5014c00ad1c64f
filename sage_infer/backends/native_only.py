"""Settings only sage's own engine carries out: another backend refuses them at start-up."""

from __future__ import annotations

from sage_infer.config.serve import ModelConfig, ServeConfig
from sage_infer.errors import ConfigError


def refuse_native_only(config: ServeConfig, backend: str, roles: bool = False) -> None:
    """`ConfigError` naming the first field set to something only the native engine does
    (tiers, tenant quotas, eviction policies, sage's linear kernels; prefill/decode roles unless
    the backend carries them out itself: `roles`)."""
    where = f"under --backend {backend}"
    if config.pd is not None and not roles:
        raise ConfigError(f"pd: sage's prefill/decode deployment (--pd) runs the native engine only, not {where}")
    if config.role != "both" and not roles:
        raise ConfigError(f"role: {config.role}: sage's prefill/decode roles run the native engine only, not "
                          f"{where}")
    tiers = config.tiers
    for name, value, off in (("tiers.host_bytes", tiers.host_bytes, (0, "auto")),
                             ("tiers.disk_path", tiers.disk_path, (None,)),
                             ("tiers.remote_url", tiers.remote_url, (None,))):
        if value not in off:
            raise ConfigError(f"{name}: sage's KV tiers do not run inside the {backend} engine ({where})",
                              hint="drop the tier (for vLLM, sage's tiers plug in through SageKVConnector)")
    quota = config.quota
    if quota.tenants or quota.default_min_share != 0.0 or quota.default_max_share != 1.0:
        raise ConfigError(f"quota: tenant KV quotas are sage's own block accounting; {backend} has none {where}")
    if config.policy.eviction != "lru":
        raise ConfigError(f"policy.eviction: {config.policy.eviction}: {backend}'s prefix cache evicts LRU only "
                          f"{where}")
    model = config.model
    for name, what in (("linear", "linear kernels"), ("decode_linear", "decode linear kernel"),
                       ("attention", "attention path"), ("prefill_attention", "prefill attention"),
                       ("elementwise", "elementwise ops"), ("decode_step", "decode step loop"),
                       ("cuda_graphs", "CUDA graph setting"), ("host_malloc", "host allocator settings"),
                       ("huge_pages", "huge-page setting"), ("deterministic", "batch-invariant kernels")):
        value, default = getattr(model, name), ModelConfig.model_fields[name].default
        if value != default:
            raise ConfigError(f"model.{name}: {value} picks sage's own {what}; {backend} chooses its own {where}",
                              hint=f"leave model.{name} at {default}")
    if not config.model.cascade_attention:
        raise ConfigError(f"model.cascade_attention: false turns off sage's cascade attention; {backend} 0.32 has "
                          f"none to turn off {where}", hint="leave model.cascade_attention at true")
