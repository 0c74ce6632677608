"""Trainer integrations for gradientmail: Lightning and Accelerate."""
