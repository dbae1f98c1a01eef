"""Fake tensors for tracing: fake twins of a model and optimizer, fast paths, memo, fidelity checks.

Private to ``udnn_lab.analysis``; may import nothing of udnn_lab but errors and units.
"""
