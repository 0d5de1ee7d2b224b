"""A/B of two compiled plans' plain decoding in one process (reports/ab.py's paired loop):
usage: ab_plans.py PLAN_A PLAN_B [ROUNDS] [NEW_TOKENS]"""
import sys, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from ab import chat_prompts, decoder, paired
from yggtree.bench import plan_runner
torch.set_num_threads(2)
a_path, b_path = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
n = int(sys.argv[4]) if len(sys.argv) > 4 else 64
ea, tok, _ = plan_runner(a_path)[2](False)
eb, _, _ = plan_runner(b_path)[2](False)
r = paired(decoder(ea, n), decoder(eb, n), chat_prompts(tok), rounds)
print(f"A {a_path}: {r['a_ms']:.3f} ms/token  B {b_path}: {r['b_ms']:.3f}  A/B time ratio (B speed-up) "
      f"{1/r['speedup']:.3f} [{1/r['max']:.3f}, {1/r['min']:.3f}]  same {r['same']}/{r['pairs']}")
