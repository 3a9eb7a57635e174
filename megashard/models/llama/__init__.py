"""Llama (``model.arch: llama``): its blocks (:mod:`.blocks`: RMSNorm, rotary positions, SwiGLU)."""
