"""One-off (not part of the package): a profiled step's aten self CPU time beside the time model's price, by op
class and op name. Usage: python compare.py DIR (DIR holds priced.json and rank<r>.json)."""
import json
import sys

PRICED_NAMESPACES = ("aten::", "autosp_sp::", "c10d::", "_c10d_functional::")


def main(folder: str) -> None:
    priced = json.load(open(f"{folder}/priced.json"))
    trace = priced["traces"][0]
    for rank in (0, 1):
        results = json.load(open(f"{folder}/rank{rank}.json"))
        plain = [r["wall"] for r in results if not r["profiled"]]
        profiled = [r for r in results if r["profiled"]][-1]
        aten = {k: v for k, v in profiled["ops"].items() if k.startswith(PRICED_NAMESPACES)}
        other = {k: v for k, v in profiled["ops"].items() if k not in aten}
        print(f"rank{rank}: plain walls {[round(x, 3) for x in plain]}, profiled wall {profiled['wall']:.3f}, "
              f"aten self {sum(v[1] for v in aten.values()):.3f}, other self {sum(v[1] for v in other.values()):.3f}, "
              f"predicted {priced['time']['iteration_s']:.3f}")
        by_class: dict[str, list[float]] = {}
        rows = []
        for name in set(trace) | set(aten):
            count, seconds, op_class = trace.get(name, [0, 0.0, "-"])
            measured_count, measured = aten.get(name, [0, 0.0])
            totals = by_class.setdefault(op_class, [0.0, 0.0])
            totals[0] += seconds
            totals[1] += measured
            rows.append((measured - seconds, name, op_class, count, measured_count, seconds, measured))
        print("  class: priced / measured self", {k: (round(a, 3), round(b, 3)) for k, (a, b) in by_class.items()})
        for row in sorted(rows, reverse=True)[:12] + sorted(rows)[:5]:
            print(f"   {row[1]:55s} {row[2]:10s} n={row[3]:5d}/{row[4]:5d} priced {row[5]:.4f} measured {row[6]:.4f}")
        top = sorted(other.items(), key=lambda kv: -kv[1][1])[:6]
        print("  other:", [(k[:40], v[0], round(v[1], 4)) for k, v in top])


if __name__ == "__main__":
    main(sys.argv[1])
