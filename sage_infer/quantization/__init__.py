"""Quantization: the KV codec shared by the pool, tiers and transport; weight-only quantized linears;
the compressed-tensors checkpoint format; calibration."""
