import json, statistics as st, sys
keys = ["import_s", "configured_s", "load_s", "ready_s", "first_token_s", "first_answer_s"]
prefix = sys.argv[1] if len(sys.argv) > 1 else "ab"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
data = {t: [json.load(open(f"{prefix}_{t}_{r}.json")) for r in range(1, rounds + 1)] for t in ("before", "after")}
for k in keys:
    row = []
    for t in ("before", "after"):
        vals = [run[k] for d in data[t] for run in d["runs"]]
        row.append(f"{st.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})")
    ratios = [st.median([r[k] for r in b["runs"]]) / st.median([r[k] for r in a["runs"]]) for a, b in zip(data["before"], data["after"])]
    print(f"{k:15s} A {row[0]:20s} B {row[1]:20s} B/A per round {', '.join(f'{x:.2f}' for x in ratios)} median {st.median(ratios):.2f}")
for t in ("before", "after"):
    api = [run["rss_bytes"]["api"] / 2**20 for d in data[t] for run in d["runs"]]
    eng = [run["rss_bytes"]["engine_core"] / 2**20 for d in data[t] for run in d["runs"]]
    print(t, f"RSS api {st.median(api):.0f} MiB engine {st.median(eng):.0f} MiB")
