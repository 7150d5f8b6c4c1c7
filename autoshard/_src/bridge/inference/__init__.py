"""Inference mode (BBGraP): an apply function traced into layers and its partition emitted as jax."""
