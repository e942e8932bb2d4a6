import json, sys
d = sys.argv[1]
pr = json.load(open(f"{d}/priced.json"))
trace = pr["traces"][0]
for rank in (0, 1):
    res = json.load(open(f"{d}/rank{rank}.json"))
    plain = [r["wall"] for r in res if not r["profiled"]]
    prof = [r for r in res if r["profiled"]][-1]
    ops = prof["ops"]
    aten = {k: v for k, v in ops.items() if k.startswith(("aten::", "autosp_sp::", "c10d::", "_c10d_functional::"))}
    other = {k: v for k, v in ops.items() if k not in aten}
    measured_ops = sum(v[1] for v in aten.values())
    print(f"rank{rank}: plain walls {[round(x,3) for x in plain]}, profiled wall {prof['wall']:.3f}, "
          f"aten self {measured_ops:.3f}, other self {sum(v[1] for v in other.values()):.3f}, predicted {pr['time']['iteration_s']:.3f}")
    by_class = {}
    names = set(trace) | set(aten)
    rows = []
    for n in names:
        c, s, cls = trace.get(n, [0, 0.0, "-"])
        mc, ms = aten.get(n, [0, 0.0])
        by_class.setdefault(cls, [0.0, 0.0])
        by_class[cls][0] += s; by_class[cls][1] += ms
        rows.append((ms - s, n, cls, c, mc, s, ms))
    print("  class: priced / measured self", {k: (round(a, 3), round(b, 3)) for k, (a, b) in by_class.items()})
    for r in sorted(rows, reverse=True)[:12]:
        print(f"   {r[1]:55s} {r[2]:10s} n={r[3]:5d}/{r[4]:5d} priced {r[5]:.4f} measured {r[6]:.4f}")
    for r in sorted(rows)[:5]:
        print(f"   {r[1]:55s} {r[2]:10s} n={r[3]:5d}/{r[4]:5d} priced {r[5]:.4f} measured {r[6]:.4f}")
    top_other = sorted(other.items(), key=lambda kv: -kv[1][1])[:6]
    print("  other:", [(k[:40], v[0], round(v[1], 4)) for k, v in top_other])
