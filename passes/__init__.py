"""Optimization passes (onnxcampo.passes)."""
