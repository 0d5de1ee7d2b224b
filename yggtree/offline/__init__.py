"""Offline tools: profiling, fitting, training, plan search, compilation."""
