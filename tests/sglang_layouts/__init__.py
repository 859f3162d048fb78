"""A stand-in for SGLang 0.5.17's parallel layouts, on CPU processes over gloo (test_sglang_layouts.py)."""
