"""The model (gpt), its configuration (config: no torch, read by the flag parser) and its
kernels: FlashAttention-4 document segments (flash4) and the fused cross-entropy
(fused_ce)."""
