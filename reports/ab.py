"""The paired A/B loop the reports' engine measurements share (reports/*/ab_*.py).

Two decoders run each of 8 chat prompts of our own in turn, the order alternating by prompt and
round, so drifting host speed hits both alike; a decoder maps prompt ids to (decode ms per
token, prefill excluded; the tokens). :func:`paired` returns both medians, the median of the
per-pair ratios (B's time over A's: A's speed-up) with the smallest and largest, and how many
pairs gave the same tokens."""
import statistics

from yggtree.runtime.engine import SamplingParams

QUESTIONS = ["Explain how a hash table works.", "Write a haiku about autumn rain.", "What causes the seasons on Earth?",
             "Give three tips for writing clean Python code.", "Summarise the plot of Romeo and Juliet.",
             "How do I reverse a linked list in C?", "Compare TCP and UDP briefly.", "Why is the sky blue?"]


def chat_prompts(tok) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    return_dict=False) for q in QUESTIONS]


def decoder(engine, new_tokens: int = 64):
    """``ids -> (decode ms per token, tokens)`` of ``engine``'s greedy generate."""
    params = SamplingParams(max_new_tokens=new_tokens)

    def run(ids):
        r = engine.generate(ids, params)
        return (r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1), r.token_ids

    return run


def paired(a, b, prompts, rounds: int = 3) -> dict:
    a(prompts[0]), b(prompts[0])  # warm-up
    ta, tb, same = [], [], 0
    for rnd in range(rounds):
        for i, ids in enumerate(prompts):
            if (i + rnd) % 2:
                x = a(ids); y = b(ids)
            else:
                y = b(ids); x = a(ids)
            ta.append(x[0]); tb.append(y[0]); same += x[1] == y[1]
    r = [q / p for p, q in zip(ta, tb)]
    return {"a_ms": statistics.median(ta), "b_ms": statistics.median(tb), "speedup": statistics.median(r),
            "min": min(r), "max": max(r), "same": same, "pairs": len(r)}
