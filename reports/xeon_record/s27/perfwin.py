import sys, collections
lo, hi = float(sys.argv[1]), float(sys.argv[2])
rows=[]; want=False
for line in sys.stdin:
    if 'cpu-clock' in line:
        parts=line.split(); t=float(parts[2].rstrip(':')); tid=parts[1]; want=True; continue
    if want and line.strip():
        sym=line.split(None,1)[1].rsplit(' (',1); rows.append((t,tid,sym[0].split('+0x')[0][:90], sym[1][:40] if len(sym)>1 else '')); want=False
t0=rows[0][0]
win=[r for r in rows if lo <= r[0]-t0 < hi]
tids=collections.Counter(r[1] for r in win)
print('samples', len(win), 'threads', tids.most_common(4))
for tid,_ in tids.most_common(2):
    c=collections.Counter(r[2] for r in win if r[1]==tid); n=sum(c.values())
    print('thread', tid, n)
    for s,k in c.most_common(14): print(f'  {100*k/n:5.1f}%  {s}')
