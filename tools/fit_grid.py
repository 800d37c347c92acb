#!/usr/bin/env python3
"""Measures kiln fit against the whole recipe grid (issue 33; a benchmark, not a test).

For MODEL and an effective batch E, every recipe kiln fit searches (per-device batch x
gradient accumulation = E, fp32 / bf16, remat none / blocks / sqrt / min-cut / budget,
adamw_torch / adamw_8bit) is measured with `kiln bench` (one bench per batch size and
precision, its remat x optimizer variants interleaved), independently of kiln fit's own
measuring. Then, for budgets at the given fractions of the plain recipe's planned peak
(E x 1, fp32, no remat, adamw_torch), `kiln fit` chooses a recipe, and the script checks:
  - the chosen recipe's measured peak (kiln fit's and the grid's) is within the budget;
  - its grid time per optimizer step is within 10% of the fastest fitting grid recipe;
  - the cost model's ranking of the fitting recipes against the grid's times (Spearman);
  - the search's wall time.
Prints markdown tables (docs/performance.md keeps them). Standard library only.

Usage: tools/fit_grid.py MODEL --effective_batch_size E [--fractions 0.25,0.4,0.6,1.0]
                         [--steps 3] [--kiln build/bin/kiln] [--work DIR]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

REMATS = ["none", "blocks", "sqrt", "min-cut"]
OPTIMS = ["adamw_torch", "adamw_8bit"]


def run(cmd, log):
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.time() - t0
    log.write("$ " + " ".join(cmd) + "\n" + p.stdout + p.stderr + "\n")
    log.flush()
    return p, dt


def seconds(text):
    m = re.fullmatch(r"([0-9.]+) (us|ms|s)", text.strip())
    if not m:
        raise ValueError("not a time: %r" % text)
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def nbytes(text):
    m = re.fullmatch(r"([0-9.]+) (B|KiB|MiB|GiB)", text.strip())
    if not m:
        raise ValueError("not a size: %r" % text)
    return float(m.group(1)) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]


def bench_rows(out):
    """(median seconds, measured peak bytes, planned peak bytes) per variant row of a bench table."""
    rows = []
    lines = out.splitlines()
    m = re.search(r"median step time ([0-9.]+ (?:us|ms|s)) \|", out)
    if m:  # one variant: a summary instead of a table
        pm = re.search(r"peak memory: planned [0-9.]+ \w+ \(([0-9]+) B\), measured [0-9.]+ \w+ \(([0-9]+) B\)", out)
        return [(seconds(m.group(1)), float(pm.group(2)), float(pm.group(1)))]
    start = next(i for i, l in enumerate(lines) if l.startswith("variant") or l.startswith("backend"))
    for l in lines[start + 1:]:
        if l.startswith("tensor allocations"):
            break
        # label, median (2 tokens), samples/s, vs, peak measured (2), peak planned (2), build (2)
        t = l.split()
        rows.append((seconds(" ".join(t[1:3])), nbytes(" ".join(t[5:7])), nbytes(" ".join(t[7:9]))))
    return rows


def ranks(v):
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2.0 + 1
        i = j + 1
    return r


def spearman(a, b):
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va > 0 and vb > 0 else float("nan")


def key(b, a, prec, remat, optim):
    return "%dx%d %s %s %s" % (b, a, prec, remat, optim)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--effective_batch_size", type=int, required=True)
    ap.add_argument("--fractions", default="0.25,0.4,0.6,1.0")
    ap.add_argument("--steps", type=int, default=3, help="timed bench steps per recipe (after 1 warm-up)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure the grid this many times; a recipe's time is its fastest round's median "
                         "(a shared machine's load only ever slows a round down)")
    ap.add_argument("--kiln", default=os.path.join(os.path.dirname(__file__), "..", "build", "bin", "kiln"))
    ap.add_argument("--work", default="build/fit_grid")
    args = ap.parse_args()
    E = args.effective_batch_size
    name = os.path.basename(os.path.dirname(os.path.abspath(args.model)))
    work = os.path.join(args.work, name)
    os.makedirs(work, exist_ok=True)
    log = open(os.path.join(work, "log.txt"), "w")
    kiln = args.kiln

    # Every recipe's plan and estimate (everything fits a budget of 1 TiB).
    all_json = os.path.join(work, "all.json")
    p, _ = run([kiln, "fit", args.model, "--memory_budget", "1TiB", "--effective_batch_size", str(E),
                "--measure_top", "0", "--report_json", all_json], log)
    if p.returncode != 0:
        sys.exit("kiln fit failed: " + p.stderr.strip())
    allr = json.load(open(all_json))
    est = {c["label"]: c for c in allr["candidates"]}
    plain = est[key(E, 1, "fp32", "none", "adamw_torch")]["planned_peak"]

    # The grid (remat budget aside): one bench per batch size and precision.
    grid = {}
    divs = [b for b in range(E, 0, -1) if E % b == 0]
    grid_file = os.path.join(work, "grid.json")  # delete it to measure the grid again
    if os.path.exists(grid_file):
        grid = {k: tuple(v) for k, v in json.load(open(grid_file)).items()}
        divs = []
    for b in [d for _ in range(args.rounds) for d in divs]:
        for prec in ["fp32", "bf16"]:
            cmd = [kiln, "bench", args.model, "--per_device_train_batch_size", str(b),
                   "--gradient_accumulation_steps", str(E // b), "--remat_policy", ",".join(REMATS),
                   "--optim", ",".join(OPTIMS), "--warmup_steps_bench", "1", "--bench_steps", str(args.steps)]
            if prec == "bf16":
                cmd.append("--bf16")
            p, _ = run(cmd, log)
            if p.returncode != 0:
                sys.exit("kiln bench failed: " + p.stderr.strip())
            rows = bench_rows(p.stdout)
            i = 0
            for r in REMATS:
                for o in OPTIMS:
                    k = key(b, E // b, prec, r, o)
                    grid[k] = min(grid[k], rows[i]) if k in grid else rows[i]
                    i += 1
            print("measured %d x %d %s" % (b, E // b, prec), file=sys.stderr)

    json.dump({k: list(v) for k, v in grid.items()}, open(grid_file, "w"), indent=1)

    results = []
    for f in [float(x) for x in args.fractions.split(",")]:
        budget = int(plain * f)
        fj = os.path.join(work, "fit_%g.json" % f)
        p, wall = run([kiln, "fit", args.model, "--memory_budget", str(budget), "--effective_batch_size", str(E),
                       "--report_json", fj], log)
        fr = json.load(open(fj)) if p.returncode == 0 else None
        # This budget's remat-budget recipes that recompute something and fit: measured too.
        local = dict(grid)
        if fr:
            groups = {}
            for c in fr["candidates"]:
                if c["remat_policy"] == "budget" and c["fits"] and c["same_as"] < 0:
                    prec = "bf16" if c["bf16"] else "fp16" if c["fp16"] else "fp32"
                    groups.setdefault((c["per_device_train_batch_size"], prec), []).append(c["optim"])
            # As the grid: interleaved with the same recipes without remat (variants measured
            # alone run under other conditions), the fastest of `rounds` rounds.
            for (b, prec), optims in [g for _ in range(args.rounds) for g in sorted(groups.items())]:
                cmd = [kiln, "bench", args.model, "--per_device_train_batch_size", str(b),
                       "--gradient_accumulation_steps", str(E // b), "--remat_policy", "none,budget",
                       "--memory_budget", str(budget), "--optim", ",".join(optims), "--warmup_steps_bench", "1",
                       "--bench_steps", str(args.steps)]
                if prec == "bf16":
                    cmd.append("--bf16")
                q, _ = run(cmd, log)
                if q.returncode == 0:
                    rows = bench_rows(q.stdout)[len(optims):]  # the budget rows follow the none rows
                    for o, row in zip(optims, rows):
                        k = key(b, E // b, prec, "budget", o)
                        local[k] = min(local[k], row) if k in local else row
        # Fitting: the search's exact planned peak within the budget.
        fitting = {}
        if fr:
            for c in fr["candidates"]:
                if c["fits"] and c["same_as"] < 0 and c["label"] in local:
                    fitting[c["label"]] = c
        fastest = min(fitting, key=lambda k: local[k][0]) if fitting else None
        chosen = next((c for c in fr["candidates"] if c["chosen"]), None) if fr else None
        row = {"fraction": f, "budget": budget, "search_s": wall, "fitting": len(fitting),
               "fastest": fastest, "fastest_s": local[fastest][0] if fastest else None,
               "chosen": chosen["label"] if chosen else None,
               "chosen_grid_s": local.get(chosen["label"], (None,))[0] if chosen else None,
               "chosen_fit_s": chosen["measured_s"] if chosen else None,
               "chosen_peak": chosen["measured_peak"] if chosen else None,
               "chosen_grid_peak": local.get(chosen["label"], (None, None))[1] if chosen else None,
               "error": None if fr else p.stderr.strip()}
        # The cost model's ranking of this budget's fitting recipes against the grid.
        labels = sorted(fitting)
        row["spearman"] = spearman([fitting[k]["estimated_s"] for k in labels], [local[k][0] for k in labels]) \
            if len(labels) > 2 else float("nan")
        results.append(row)
        print("budget %g done" % f, file=sys.stderr)

    # Over every measured recipe (the 100% budget's fitting set is nearly the whole grid).
    labels = sorted(k for k in grid if k in est)
    rho_all = spearman([est[k]["estimated_s"] for k in labels], [grid[k][0] for k in labels])

    mib = lambda b: "%.2f MiB" % (b / 2**20)
    print("\n### %s, effective batch %d (plain recipe's planned peak %s)\n" % (name, E, mib(plain)))
    print("| budget | fitting | fastest in the grid | its ms/step | chosen by kiln fit | chosen, grid ms/step "
          "| vs fastest | chosen, kiln fit's ms/step | chosen measured peak (fit / grid) | within budget "
          "| Spearman (fitting) | search s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["error"]:
            print("| %d%% %s | - | - | - | %s | | | | | | | %.1f |" % (r["fraction"] * 100, mib(r["budget"]),
                                                                  r["error"], r["search_s"]))
            continue
        ratio = r["chosen_grid_s"] / r["fastest_s"] if r["chosen_grid_s"] and r["fastest_s"] else float("nan")
        within = r["chosen_peak"] is not None and r["chosen_peak"] <= r["budget"] and \
            (r["chosen_grid_peak"] is None or r["chosen_grid_peak"] <= r["budget"] + 0.005 * 2**20)
        print("| %d%% %s | %d | %s | %.1f | %s | %s | %.3f | %.1f | %s / %s | %s | %.3f | %.1f |" % (
            r["fraction"] * 100, mib(r["budget"]), r["fitting"], r["fastest"], r["fastest_s"] * 1e3, r["chosen"],
            "%.1f" % (r["chosen_grid_s"] * 1e3) if r["chosen_grid_s"] else "-", ratio,
            r["chosen_fit_s"] * 1e3, mib(r["chosen_peak"]),
            mib(r["chosen_grid_peak"]) if r["chosen_grid_peak"] else "-", "yes" if within else "NO",
            r["spearman"], r["search_s"]))
    print("\nSpearman rank correlation of the cost model's estimates with the grid's measured times over all "
          "%d measured recipes: %.3f" % (len(labels), rho_all))
    json.dump({"results": results, "spearman_all": rho_all,
               "grid": {k: list(v) for k, v in grid.items()}}, open(os.path.join(work, "summary.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
