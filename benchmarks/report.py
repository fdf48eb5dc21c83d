#!/usr/bin/env python3
"""The benchmark tables and plots of the docs, from the JSON files of one benchmark run.

    python3 benchmarks/report.py --bench out/bench.json --decode out/decode.json \\
        --save docs/bench/results.json --plots docs/bench --readme README.md --docs docs/benchmarks.md \\
        [--date 2026-12-01 --commit abc1234]
    python3 benchmarks/report.py --results docs/bench/results.json --plots docs/bench --readme README.md \\
        --docs docs/benchmarks.md                                       # again, from the saved run
    python3 benchmarks/report.py --bench out/bench.json --decode out/decode.json     # the tables on stdout
    python3 benchmarks/report.py --results docs/bench/results.json --overhead out/overhead.json \
        --save docs/bench/results.json --docs docs/benchmarks.md       # add a bench_overhead.py run to the saved one
    python3 benchmarks/report.py --results docs/bench/results.json --fp8 out/fp8.json --commit abc1234 \\
        --save docs/bench/results.json --docs docs/benchmarks.md --plots docs/bench   # and a bench_fp8.py run

Inputs: `benchmarks/bench_attention.py --op all --json` (a list of rows, field "op" = fwd / bwd, and "varlen" rows
that `benchmarks/bench_varlen.py --append` adds) and `benchmarks/bench_decode.py --json` (a dict whose "rows" hold
one decode cell each), `benchmarks/bench_overhead.py --json` (--overhead: a dict whose "rows" hold one entry point
beside its peer each) and `benchmarks/bench_fp8.py --json` (--fp8: a dict whose "rows" hold one FP8 cell each, with
its peers). --save writes them into one file ({"meta", "bench", "decode", "overhead", "fp8"}) that --results reads
back; --overhead and --fp8, runs of their own (SIDE_RUNS), replace that part of the saved run and leave the rest as
it is.

Outputs:
- --docs: the full table of each operation, written between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` for
  NAME in run, forward, backward, varlen, decode, overhead, fp8 (a marker pair that is absent is reported and
  skipped; run is written only with forward, backward, varlen or decode rows, overhead and fp8 carry their own run
  lines);
- --readme: the compact tables between the same markers: per head dim and mask (decode: per batch) each
  implementation's range over the sequence lengths, and cuflash's ratios to SDPA flash and cuDNN;
- --plots DIR: forward.png, backward.png, fp8.png (TFLOP/s against seqlen per head dim and mask) and decode.png
  (TB/s of K/V read against the cache length per batch), with matplotlib (Agg).
Ratios are cuflash over the peer in throughput (TFLOP/s, or the peer's time over cuflash's in decode); bold marks
those below 1. The overhead table's ratios are times, cuflash's over the peer's: bold marks those above 1.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

OPS = ("run", "forward", "backward", "varlen", "decode", "overhead", "fp8")
PEERS = ("flash", "cudnn")
SIDE_RUNS = ("overhead", "fp8")  # runs of their own, each with its own device, date and commit


# --------------------------------------------------------------------------- loading
def load(bench: str | None, decode: str | None, results: str | None, overhead: str | None = None,
         fp8: str | None = None) -> dict:
    """{"meta": {...}, "bench": [rows], "decode": {...} or None, "overhead": {...} or None, "fp8": {...} or None}
    from the saved results or the run files (an overhead or fp8 file given with the saved results replaces theirs);
    a file that is not there is left out with a note on stderr."""
    if results:
        saved = json.loads(Path(results).read_text())
        data = dict(meta=saved.get("meta", {}), bench=saved.get("bench", []), decode=saved.get("decode"),
                    **{side: saved.get(side) for side in SIDE_RUNS})
        paths = ((overhead, "overhead"), (fp8, "fp8"))
    else:
        data = dict(meta={}, bench=[], decode=None, **{side: None for side in SIDE_RUNS})
        paths = ((bench, "bench"), (decode, "decode"), (overhead, "overhead"), (fp8, "fp8"))
    for path, key in paths:
        if not path:
            continue
        if not Path(path).exists():
            print(f"report: {path} not found; no {key} tables", file=sys.stderr)
            continue
        data[key] = json.loads(Path(path).read_text())
    rows = data["bench"]
    if rows and not results:
        first = rows[0]
        for key in ("device", "dtype", "timestamp", "torch_version", "cudnn_version", "triton_version", "cupy_version",
                    "placements"):
            if first.get(key) is not None:
                data["meta"][key] = first[key]
    return data


def rows_of(data: dict, op: str) -> list[dict]:
    rows = [r for r in data["bench"] if r.get("op") == op and not r.get("error_cell")]
    return sorted(rows, key=lambda r: (r.get("part", ""), r["d"], bool(r["causal"]), r.get("seqlen") or 0))


# --------------------------------------------------------------------------- formatting
def num(x, spec=".1f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "n/a"


def ratio(x, spec=".3f") -> str:
    if not isinstance(x, (int, float)):
        return "n/a"
    text = format(x, spec)
    return f"**{text}**" if x < 1.0 else text


def span(values, spec=".1f", bold=False) -> str:
    """'lo-hi' over the values that are numbers (one value alone; n/a if none); bold lo below 1 when `bold`."""
    xs = [x for x in values if isinstance(x, (int, float))]
    if not xs:
        return "n/a"
    lo, hi = min(xs), max(xs)
    text = format(lo, spec) if format(lo, spec) == format(hi, spec) else f"{format(lo, spec)}-{format(hi, spec)}"
    return f"**{text}**" if bold and lo < 1.0 else text


def yes_no(causal) -> str:
    return "yes" if causal else "no"


def table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def keys_text(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def decode_ratio(row: dict, peer: str):
    us, cf = row.get(f"{peer}_us"), row.get("cuflash_us")
    return us / cf if (us and cf) else None


# --------------------------------------------------------------------------- full tables (docs)
def run_text(data: dict) -> str:
    m = data["meta"]
    parts = [m.get("device", "GPU"), m.get("dtype", "bf16")]
    if m.get("date") or m.get("timestamp"):
        parts.append(str(m.get("date") or m["timestamp"][:10]))
    if m.get("commit"):
        parts.append(f"commit {m['commit']}")
    versions = []
    if m.get("torch_version"):
        versions.append(f"torch {m['torch_version']}")
    if m.get("cudnn_version"):
        c = int(m["cudnn_version"])
        versions.append(f"cuDNN {c // 10000}.{c // 100 % 100}.{c % 100}")
    if m.get("cupy_version"):
        versions.append(f"CuPy {m['cupy_version']}")
    text = "Run: " + ", ".join(parts) + (f" ({', '.join(versions)})" if versions else "") + "."
    if m.get("placements"):
        text += f" Forward and backward times: medians over {m['placements']} placements of each cell's tensors."
    for op, title in (("bwd", "Backward"), ("decode", "Decode")):  # tables measured in another run than the rest
        if m.get(f"{op}_date") or m.get(f"{op}_commit"):
            text += f" {title}: " + ", ".join(str(m[k]) if k.endswith("_date") else f"commit {m[k]}"
                                              for k in (f"{op}_date", f"{op}_commit") if m.get(k)) + "."
    return text


def forward_table(rows: list[dict]) -> str:
    body = [[str(r["d"]), yes_no(r["causal"]), str(r["seqlen"]), num(r.get("tflops_cuflash")),
             num(r.get("tflops_flash")), num(r.get("tflops_cudnn")), ratio(r.get("ratio_flash")),
             ratio(r.get("ratio_cudnn"))] for r in rows]
    return table(["d", "causal", "seqlen", "cuflash", "SDPA flash", "cuDNN", "cf/flash", "cf/cudnn"],
                 "rlrrrrrr", body)


def backward_table(rows: list[dict]) -> str:
    body = [[str(r["d"]), yes_no(r["causal"]), str(r["seqlen"]), num(r.get("tflops_cuflash")),
             num(r.get("tflops_cuflash_det")), num(r.get("tflops_flash")), num(r.get("tflops_cudnn")),
             ratio(r.get("ratio_flash")), ratio(r.get("ratio_cudnn")), num(r.get("ratio_det_atomic"), ".3f")]
            for r in rows]
    return table(["d", "causal", "seqlen", "cuflash", "cuflash det", "SDPA flash", "cuDNN", "cf/flash", "cf/cudnn",
                  "det/atomic time"], "rlrrrrrrrr", body)


def varlen_table(rows: list[dict]) -> str:
    parts = []
    equal = [r for r in rows if r.get("part") == "equal"]
    if equal:
        body = [[str(r["d"]), yes_no(r["causal"]), str(r["seqlen"]), str(r.get("batch", "")),
                 num(r.get("tflops_varlen")), num(r.get("tflops_padded")), num(r.get("ratio_padded"), ".3f")]
                for r in equal]
        parts.append("Equal lengths (varlen against the padded call on the same tokens), TFLOP/s:\n\n"
                     + table(["d", "causal", "seqlen", "sequences", "varlen", "padded", "varlen/padded"],
                             "rlrrrrr", body))
    mixed = [r for r in rows if r.get("part") == "mixed"]
    if mixed:
        fp8 = any("tflops_varlen_fp8" in r for r in mixed)  # bench_varlen.py --fp8
        body = [[str(r["d"]), yes_no(r["causal"]), str(r.get("tokens", "")), num(r.get("tflops_varlen")),
                 *([num(r.get("tflops_varlen_fp8"))] if fp8 else []),
                 num(r.get("tflops_padded")), num(r.get("tflops_flash")), num(r.get("tflops_cudnn")),
                 ratio(r.get("ratio_flash"), ".2f"), ratio(r.get("ratio_cudnn"), ".2f"),
                 num(r.get("tflops_varlen_bwd")), num(r.get("tflops_padded_bwd"))] for r in mixed]
        parts.append("Mixed lengths (peers on the padded batch), effective TFLOP/s counting real tokens only:\n\n"
                     + table(["d", "causal", "tokens", "varlen", *(["varlen fp8"] if fp8 else []), "padded cuflash",
                              "SDPA flash", "cuDNN", "/flash", "/cudnn", "varlen bwd", "padded bwd"],
                             "rlrr" + "r" * fp8 + "rrrrrrr", body))
    return "\n\n".join(parts)


def decode_table(dec: dict) -> str:
    body = [[str(r["batch"]), keys_text(r["len"]), num(r.get("kv_mb"), ".0f"), num(r.get("cuflash_us")),
             num(r.get("cuflash_tbs"), ".2f"), num(r.get("paged_us")), num(r.get("flash_us")),
             num(r.get("cudnn_us")), ratio(decode_ratio(r, "flash")), ratio(decode_ratio(r, "cudnn"))]
            for r in dec["rows"]]
    return table(["batch", "keys", "K/V MB", "cuflash us", "TB/s", "paged us", "SDPA flash us", "cuDNN us",
                  "cf/flash", "cf/cudnn"], "rrrrrrrrrr", body)


def time_ratio(x, spec=".2f") -> str:
    """A time ratio, cuflash's over the peer's: bold above 1 (cuflash the slower)."""
    if not isinstance(x, (int, float)):
        return "n/a"
    text = format(x, spec) + "x"
    return f"**{text}**" if x > 1.0 else text


def gpu_us(row: dict, impl: str) -> str:
    """GPU microseconds per call; "≤" where bench_overhead.py measured an upper bound only."""
    x = row.get(f"{impl}_gpu_us")
    return ("" if row.get(f"{impl}_gpu_exact", True) else "≤") + num(x) if isinstance(x, (int, float)) else "n/a"


def side_run_text(run: dict, dtype: str) -> str:
    """The run line of a run of its own (SIDE_RUNS): device, dtype, date, commit and versions."""
    v = run.get("versions") or {}
    versions = [f"{name} {v[key]}" for name, key in (("torch", "torch"), ("CuPy", "cupy"), ("JAX", "jax"))
                if v.get(key)]
    if v.get("cudnn"):
        c = int(v["cudnn"])
        versions.insert(1, f"cuDNN {c // 10000}.{c // 100 % 100}.{c % 100}")
    parts = [run.get("gpu", "GPU"), run.get("dtype", dtype)] + ([str(run["date"])[:10]] if run.get("date") else [])
    if run.get("commit"):
        parts.append(f"commit {run['commit']}")
    return "Run: " + ", ".join(parts) + (f" ({', '.join(versions)})" if versions else "") + "."


def overhead_text(ov: dict) -> str:
    """bench_overhead.py's run: its run line, one table row per entry point beside its peer, the shapes, and
    whether every torch entry point is at most 1.0x its SDPA peer."""
    lines = [side_run_text(ov, "bfloat16")]
    rows = ov.get("rows", [])
    body = [[f"{r['group']} {r['call']}", r["shape"], r.get("peer", ""), num(r.get("cuflash_us")),
             num(r.get("peer_us")), time_ratio(r.get("ratio")), gpu_us(r, "cuflash"), gpu_us(r, "peer"),
             num(r.get("cupy_us"))] for r in rows]
    lines += ["", table(["call", "shape", "peer", "cuflash us", "peer us", "cf/peer", "cuflash GPU us", "peer GPU us",
                         "CuPy API us"], "lllrrrrrr", body)]
    shapes = {}
    for r in rows:
        shapes.setdefault(r["shape"], r.get("dims", ""))
    if shapes:
        lines += ["", "Shapes: " + "; ".join(f"{name}: {dims}" for name, dims in shapes.items()) + "."]
    if any(r.get(f"{impl}_gpu_exact") is False for r in rows for impl in ("cuflash", "peer")):
        lines += ["", "≤: an upper bound (the host fell behind the queued calls)."]
    notes = [f"{r['group']} {r['call']}, {r['shape']}: {r.get('error') or r.get('peer_error')}" for r in rows
             if r.get("error") or r.get("peer_error")]
    if notes:
        lines += ["", "Not measured or measured against a fallback: " + "; ".join(notes) + "."]
    if ov.get("jax_skipped"):
        lines += ["", f"JAX rows skipped: {ov['jax_skipped']}."]
    torch_rows = [r for r in rows if r.get("group") == "torch"]
    if torch_rows:
        timed = [r for r in torch_rows if isinstance(r.get("ratio"), (int, float))]
        within = sum(r["ratio"] <= 1.0 for r in timed)
        ok = len(timed) == len(torch_rows) and within == len(timed)
        worst = max(timed, key=lambda r: r["ratio"], default=None)
        lines += ["", f"Every torch entry point at most 1.0x its SDPA peer's wall time: **{'yes' if ok else 'no'}** "
                      f"({within} of {len(torch_rows)} rows"
                      + (f"; highest: {worst['call']}, {worst['shape']}, {worst['ratio']:.2f}x" if worst else "")
                      + ")."]
    return "\n".join(lines)


def fp8_text(run: dict) -> str:
    """bench_fp8.py's run: its run line with the FP8 GEMM ceiling, and a row per cell: cuflash's FP8 forward, its
    fraction of the ceiling, cuDNN's FP8 attention, cuflash and cuDNN in bf16 (TFLOP/s), and the FP8 forward over
    each cuDNN column."""
    line = side_run_text(run, "e4m3")
    ceiling = run.get("scaled_mm_tflops")
    if isinstance(ceiling, (int, float)):
        line = line[:-1] + f"; `torch._scaled_mm` e4m3 8192^3 at {ceiling:.1f} TFLOP/s."
    body = []
    for r in sorted(run.get("rows", []), key=lambda r: (r["d"], bool(r["causal"]), r["seqlen"])):
        fp8 = r.get("tflops_cuflash_fp8")

        def over(x):
            return fp8 / x if isinstance(fp8, (int, float)) and isinstance(x, (int, float)) and x else None
        body.append([str(r["d"]), yes_no(r["causal"]), str(r["seqlen"]), num(fp8),
                     num(over(ceiling), ".2f"), num(r.get("tflops_cudnn_fp8")),
                     num(r.get("tflops_cuflash_bf16")), num(r.get("tflops_cudnn_bf16")),
                     ratio(over(r.get("tflops_cudnn_fp8")), ".2f"), ratio(over(r.get("tflops_cudnn_bf16")), ".2f")])
    header = ["d", "causal", "seqlen", "cuflash fp8", "of `_scaled_mm`", "cuDNN fp8", "cuflash bf16", "cuDNN bf16",
              "fp8/cuDNN fp8", "fp8/cuDNN bf16"]
    return line + "\n\n" + table(header, "rlrrrrrrrr", body)


# --------------------------------------------------------------------------- compact tables (README)
def compact_training(rows: list[dict], det: bool = False) -> str:
    """Per (head dim, mask): each implementation's TFLOP/s over the seqlens (lo-hi) and cuflash's ratios."""
    body = []
    for d, causal in sorted({(r["d"], bool(r["causal"])) for r in rows}):
        sub = [r for r in rows if r["d"] == d and bool(r["causal"]) == causal]
        cells = [str(d), yes_no(causal), span(r.get("tflops_cuflash") for r in sub)]
        if det:
            cells.append(span(r.get("tflops_cuflash_det") for r in sub))
        cells += [span(r.get("tflops_flash") for r in sub), span(r.get("tflops_cudnn") for r in sub),
                  span((r.get("ratio_flash") for r in sub), ".3f", bold=True),
                  span((r.get("ratio_cudnn") for r in sub), ".3f", bold=True)]
        if det:
            cells.append(span((r.get("ratio_det_atomic") for r in sub), ".3f"))
        body.append(cells)
    header = ["d", "causal", "cuflash"] + (["cuflash det"] if det else []) + ["SDPA flash", "cuDNN", "x SDPA flash",
                                                                          "x cuDNN"]
    header += ["det/atomic time"] if det else []
    return table(header, "rl" + "r" * (len(header) - 2), body)


def compact_decode(dec: dict) -> str:
    """Per batch: each implementation's microseconds over the cache lengths (lo-hi) and cuflash's ratios."""
    body = []
    rows = dec["rows"]
    for b in sorted({r["batch"] for r in rows}):
        sub = [r for r in rows if r["batch"] == b]
        body.append([str(b), span(r.get("cuflash_us") for r in sub), span((r.get("cuflash_tbs") for r in sub), ".2f"),
                     span(r.get("flash_us") for r in sub), span(r.get("cudnn_us") for r in sub),
                     span((decode_ratio(r, "flash") for r in sub), ".3f", bold=True),
                     span((decode_ratio(r, "cudnn") for r in sub), ".3f", bold=True)])
    return table(["batch", "cuflash us", "TB/s", "SDPA flash us", "cuDNN us", "x SDPA flash", "x cuDNN"], "rrrrrrr",
                 body)


# --------------------------------------------------------------------------- assembling
def sections(data: dict, compact: bool) -> dict:
    """{marker name: markdown} for the operations the run has (the run line only with forward, backward, varlen or
    decode rows; the overhead table, docs only, carries its own)."""
    out = {}
    dec = data.get("decode") and data["decode"].get("rows")
    if data["bench"] or dec:
        out["run"] = run_text(data)
    fwd, bwd, var = rows_of(data, "fwd"), rows_of(data, "bwd"), rows_of(data, "varlen")
    if fwd:
        out["forward"] = compact_training(fwd) if compact else forward_table(fwd)
    if bwd:
        out["backward"] = compact_training(bwd, det=True) if compact else backward_table(bwd)
    if var and not compact:
        out["varlen"] = varlen_table(var)
    if dec:
        out["decode"] = compact_decode(data["decode"]) if compact else decode_table(data["decode"])
    if data.get("overhead") and data["overhead"].get("rows") and not compact:
        out["overhead"] = overhead_text(data["overhead"])
    if data.get("fp8") and data["fp8"].get("rows") and not compact:
        out["fp8"] = fp8_text(data["fp8"])
    return out


def rewrite(path: Path, parts: dict) -> list[str]:
    """Replaces the text between each `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` of the file by parts[NAME];
    returns the names whose markers the file lacks."""
    text = path.read_text()
    missing = []
    for name, body in parts.items():
        pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(<!-- /bench:{name} -->)", re.S)
        if not pattern.search(text):
            missing.append(name)
            continue
        text = pattern.sub(lambda m: m[1] + body.rstrip("\n") + "\n" + m[2], text)
    path.write_text(text)
    return missing


# --------------------------------------------------------------------------- plots
def style_axis(ax, xs: list, labels: list, title: str, xlabel: str, ylabel: str) -> None:
    """A panel's common look: log2 x axis labelled at the measured points, y from 0, grid and legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot_training(path: Path, rows: list[dict], title: str, impls: tuple, meta: dict, op: str = "fwd",
                  ceiling: float | None = None) -> None:
    """A panel per (head dim, mask) of each implementation's TFLOP/s against seqlen (dashed: cuflash's deterministic
    mode and the bf16 columns beside FP8; with `ceiling`, a dotted line at the FP8 GEMM's TFLOP/s)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["d"], bool(r["causal"])) for r in rows})
    ncols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4 * nrows), squeeze=False)
    for ax, (d, causal) in zip(axes.flat, panels):
        sub = sorted((r for r in rows if r["d"] == d and bool(r["causal"]) == causal), key=lambda r: r["seqlen"])
        xs = [r["seqlen"] for r in sub]
        for impl in impls:
            ys = [r.get(f"tflops_{impl}") for r in sub]
            if not any(isinstance(y, (int, float)) for y in ys):
                continue
            ax.plot(xs, [y if isinstance(y, (int, float)) else float("nan") for y in ys], marker="o",
                    label=LABELS.get(impl, impl), linestyle="--" if impl in DASHED else "-",
                    linewidth=2.5 if impl.startswith("cuflash") else 1.5)
        if isinstance(ceiling, (int, float)):
            ax.axhline(ceiling, linestyle=":", color="gray", label="torch._scaled_mm e4m3")
        style_axis(ax, xs, [str(x) for x in xs], f"{title}, d={d}, {'causal' if causal else 'non-causal'}",
                   "seqlen (batch = 16384 / seqlen, heads = 2048 / d)", "TFLOP/s")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(plot_title(meta, op), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_decode(path: Path, dec: dict, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = dec["rows"]
    batches = sorted({r["batch"] for r in rows})
    ncols = 2 if len(batches) > 1 else 1
    nrows = (len(batches) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.6 * nrows), squeeze=False)
    for ax, b in zip(axes.flat, batches):
        sub = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["len"])
        xs = [r["len"] for r in sub]
        for impl in ("cuflash", "paged", "flash", "cudnn"):
            ys = [r["kv_mb"] * 2**20 / r[f"{impl}_us"] / 1e6 if r.get(f"{impl}_us") else float("nan") for r in sub]
            if all(y != y for y in ys):
                continue
            ax.plot(xs, ys, marker="o", label=LABELS.get(impl, impl), linestyle="--" if impl == "paged" else "-",
                    linewidth=2.5 if impl in ("cuflash", "paged") else 1.5)
        style_axis(ax, xs, [keys_text(x) for x in xs],
                   f"decode, batch {b}, {dec.get('h', 32)} query / {dec.get('hk', 8)} KV heads, d {dec.get('d', 128)}",
                   "keys in the cache", "TB/s of K/V read")
    for ax in list(axes.flat)[len(batches):]:
        ax.axis("off")
    fig.suptitle(plot_title(meta, "decode"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_title(meta: dict, op: str = "fwd") -> str:
    """Device, dtype, date and commit of the run (of the op's own run where it has one: bwd_date, decode_commit)."""
    date = meta.get(f"{op}_date") or meta.get("date") or (meta.get("timestamp") or "")[:10]
    commit = meta.get(f"{op}_commit") or meta.get("commit")
    return ", ".join(x for x in (meta.get("device", ""), meta.get("dtype", "bf16"), date,
                                 f"commit {commit}" if commit else "") if x)


LABELS = {"cuflash": "cuflash", "cuflash_det": "cuflash deterministic", "paged": "cuflash paged",
          "flash": "SDPA flash", "cudnn": "SDPA cuDNN", "efficient": "SDPA efficient",
          "cuflash_fp8": "cuflash e4m3", "cudnn_fp8": "cuDNN e4m3", "cuflash_bf16": "cuflash bf16",
          "cudnn_bf16": "SDPA cuDNN bf16"}
DASHED = ("cuflash_det", "cuflash_bf16", "cudnn_bf16")
FP8_IMPLS = ("cuflash_fp8", "cudnn_fp8", "cuflash_bf16", "cudnn_bf16")


def plots(data: dict, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    fwd, bwd = rows_of(data, "fwd"), rows_of(data, "bwd")
    if fwd:
        plot_training(directory / "forward.png", fwd, "forward", ("cuflash", "flash", "cudnn"), data["meta"])
        written.append(directory / "forward.png")
    if bwd:
        plot_training(directory / "backward.png", bwd, "backward", ("cuflash", "cuflash_det", "flash", "cudnn"),
                      data["meta"], "bwd")
        written.append(directory / "backward.png")
    if data.get("decode") and data["decode"].get("rows"):
        plot_decode(directory / "decode.png", data["decode"], data["meta"])
        written.append(directory / "decode.png")
    run = data.get("fp8")
    if run and run.get("rows"):
        meta = dict(device=run.get("gpu", ""), dtype=run.get("dtype", "e4m3"), date=str(run.get("date", ""))[:10],
                    commit=run.get("commit"))
        plot_training(directory / "fp8.png", run["rows"], "FP8 forward", FP8_IMPLS, meta,
                      ceiling=run.get("scaled_mm_tflops"))
        written.append(directory / "fp8.png")
    return written


# --------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", help="bench_attention.py --op all --json output (fwd, bwd and varlen rows)")
    p.add_argument("--decode", help="bench_decode.py --json output")
    p.add_argument("--results", help="a file written by --save (in place of --bench and --decode)")
    p.add_argument("--overhead", help="bench_overhead.py --json output (the per-call cost table; with --results it "
                   "replaces the saved run's)")
    p.add_argument("--fp8", help="bench_fp8.py --json output (the FP8 table and plot; with --results it replaces "
                   "the saved run's)")
    p.add_argument("--save", help="write the run (meta, bench rows, decode rows) as one JSON file here")
    p.add_argument("--date", help="the run's date, for the tables' run line (default: the bench JSON's timestamp); "
                   "with --overhead or --fp8 and neither --bench nor --decode, that run's only")
    p.add_argument("--commit", help="the commit the run measured, for the run line (as --date)")
    p.add_argument("--readme", type=Path, help="rewrite the compact tables between the markers of this file")
    p.add_argument("--docs", type=Path, help="rewrite the full tables between the markers of this file")
    p.add_argument("--plots", type=Path, help="write forward.png, backward.png, decode.png, fp8.png into this folder")
    args = p.parse_args(argv)
    if not (args.results or args.bench or args.decode or args.overhead or args.fp8):
        p.error("give --results, or --bench, --decode, --overhead and/or --fp8")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    data = load(args.bench, args.decode, args.results, args.overhead, args.fp8)
    # --date and --commit describe the run files given: a side run's alone when it comes without --bench/--decode
    sides = [side for side in SIDE_RUNS if getattr(args, side)]
    for key, value in (("date", args.date), ("commit", args.commit)):
        if not value:
            continue
        if args.bench or args.decode or not sides:
            data["meta"][key] = value
        for side in sides:
            if data.get(side):
                data[side][key] = value
    if not data["bench"] and not data.get("decode") and not any(data.get(side) for side in SIDE_RUNS):
        print("report: no benchmark rows", file=sys.stderr)
        return 1
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(data, indent=1) + "\n")
    for path, compact in ((args.docs, False), (args.readme, True)):
        if path:
            for name in rewrite(path, sections(data, compact)):
                print(f"report: {path} has no <!-- bench:{name} --> ... <!-- /bench:{name} --> pair; left out",
                      file=sys.stderr)
    if args.plots:
        for path in plots(data, args.plots):
            print(f"wrote {path}")
    if not (args.docs or args.readme or args.plots or args.save):
        for name, body in sections(data, compact=False).items():
            print(f"### {name}\n\n{body}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
