"""yggtree: latency-optimal tree speculative decoding with static graphs."""
