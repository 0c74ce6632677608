"""Payload serialization: safetensors, quantization, compression."""
