"""Prometheus metrics of a server, named after vLLM's (``vllm:...``) with the ``yggtree:`` prefix.

Speculative decoding follows vLLM's spec-decode counters: a *draft* is one verify step that
checked drafted tokens (a plain step is not one), its *draft tokens* the tree nodes verified
beside the root (W_v - 1), *accepted tokens* the drafted tokens accepted (the bonus token
excluded), and ``accepted_tokens_per_pos{position="i"}`` how many drafts accepted a token at
depth i + 1 of the tree (a tree accepts one path, so position i counts the steps that accepted
more than i tokens).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """One server's metrics on their own registry (several apps in one process do not collide)."""

    def __init__(self, model: str, max_positions: int = 32) -> None:
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model = model
        self.max_positions = max_positions
        self.waiting = Gauge("yggtree:num_requests_waiting", "Requests waiting in the queue", lab, registry=r)
        self.running = Gauge("yggtree:num_requests_running", "Requests the engine is decoding", lab, registry=r)
        self.ttft = Histogram("yggtree:time_to_first_token_seconds",
                              "Time from arrival to the first generated token", lab, buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("yggtree:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", lab,
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("yggtree:inter_token_latency_seconds",
                             "Time between token emissions divided by the tokens emitted (per step)", lab,
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("yggtree:e2e_request_latency_seconds", "Time from arrival to the last token",
                             lab, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("yggtree:request_queue_time_seconds", "Time waiting in the queue", lab,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("yggtree:prompt_tokens", "Prefilled prompt tokens", lab, registry=r)
        self.generation_tokens = Counter("yggtree:generation_tokens", "Generated tokens", lab, registry=r)
        self.success = Counter("yggtree:request_success", "Finished requests by finish reason",
                               lab + ["finished_reason"], registry=r)
        self.failed = Counter("yggtree:request_failure",
                              "Requests ended without a finish (rejected, timed out, disconnected, failed)",
                              lab + ["reason"], registry=r)
        self.drafts = Counter("yggtree:spec_decode_num_drafts", "Verify steps that checked drafted tokens",
                              lab, registry=r)
        self.draft_tokens = Counter("yggtree:spec_decode_num_draft_tokens",
                                    "Drafted tokens verified (tree nodes beside the root)", lab, registry=r)
        self.accepted = Counter("yggtree:spec_decode_num_accepted_tokens",
                                "Drafted tokens accepted (bonus tokens excluded)", lab, registry=r)
        self.accepted_pos = Counter("yggtree:spec_decode_num_accepted_tokens_per_pos",
                                    "Drafts that accepted a token at this tree depth (0-based)",
                                    lab + ["position"], registry=r)
        for g in (self.waiting, self.running):
            g.labels(model).set(0)
        for c in (self.drafts, self.draft_tokens, self.accepted, self.prompt_tokens, self.generation_tokens,
                  self.ttft, self.tpot, self.itl, self.e2e, self.queue_time):
            c.labels(model)  # present (at 0) from the start

    def step(self, verify_width: int, drafted: bool, n_accepted: int) -> None:
        """One speculation step's counts."""
        if not drafted and verify_width <= 1:
            return  # a plain step
        m = self.model
        self.drafts.labels(m).inc()
        self.draft_tokens.labels(m).inc(verify_width - 1)
        self.accepted.labels(m).inc(n_accepted)
        for pos in range(min(n_accepted, self.max_positions)):
            self.accepted_pos.labels(m, str(pos)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
