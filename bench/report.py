"""Reading and drawing benchmark reports: the Markdown tables of RESULTS.md compared figure by
figure with a new run (ratio new/old), and the raw latency samples drawn as a PNG (matplotlib);
the percentile and the load-average line every bench prints."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

# Columns that name a row rather than measure something.
KEY_COLUMNS = {"callers", "RPC", "NICs", "shared devices", "what"}
# Sample counts: shown in the tables, not figures to compare.
COUNT_COLUMNS = {"calls", "runs"}

Tables = dict[tuple[str, tuple[str, ...]], dict[str, float]]


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return s[k]


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min, {os.cpu_count()} cores)"


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def parse_lines(lines: Iterable[str]) -> Tables:
    """{(table heading, row key): {column: figure}} for every Markdown table under a ### heading."""
    tables: Tables = {}
    header: list[str]
    heading, header = "", []
    for raw in lines:
        line = raw.strip()
        if line.startswith("### "):
            heading, header = line[4:], []
        elif line.startswith("|") and heading:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not header:
                header = cells
            elif not set(line) <= set("|-: "):
                row = dict(zip(header, cells, strict=False))
                key = tuple(row[c] for c in header if c in KEY_COLUMNS)
                figures = {
                    c: n
                    for c, v in row.items()
                    if c not in KEY_COLUMNS | COUNT_COLUMNS and (n := _number(v)) is not None
                }
                tables[(heading, key)] = figures
        elif not line:
            header = []
    return tables


def parse_tables(path: str) -> Tables:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return parse_lines(fh)


def compare(new: Tables, old: Tables, old_name: str) -> list[str]:
    """Every figure of the new run next to its ratio to the same figure in ``old``."""
    out = [f"### Compared with {old_name} (each figure: new value, then new/old; >1 = more time, bytes or CPU)", ""]
    if not old:
        return [*out, f"({old_name} not found: nothing to compare)"]
    heading = None
    for (table, key), figures in new.items():
        before = old.get((table, key))
        if before is None:
            continue
        if table != heading:
            heading = table
            out += ["", f"{table}:"]
        cells = []
        for column, value in figures.items():
            base = before.get(column)
            ratio = f"x{value / base:.2f}" if base else "x-"
            cells.append(f"{column} {value:g} ({ratio})")
        out.append(f"  {' / '.join(key) or '-'}: " + "; ".join(cells))
    if heading is None:
        out.append("(no table of this run matches one in the baseline: different sections or --quick)")
    return out


BEGIN, END = "<!-- bench_plugin.py output: begin -->", "<!-- bench_plugin.py output: end -->"


def write_results(path: str, lines: Sequence[str]) -> None:
    """Replace the part of ``path`` between the BEGIN/END markers (the prose around it stays);
    a file without them is written whole."""
    body = "\n".join([BEGIN, *lines, END])
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        body = head + body + rest.split(END, 1)[1]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(body if body.endswith("\n") else body + "\n")


def write_section(path: str, name: str, text: str, after: str = "") -> None:
    """Put ``text`` between ``name``'s output markers in ``path``: in their place when the file has
    them, else right after the marker ``after`` (another bench's end), else at the end."""
    begin, end = f"<!-- {name} output: begin -->", f"<!-- {name} output: end -->"
    old = Path(path).read_text(encoding="utf-8") if os.path.exists(path) else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in old and end in old:
        new = old.split(begin)[0] + block + old.split(end, 1)[1]
    elif after and after in old:
        head, tail = old.split(after, 1)
        new = f"{head}{after}\n\n{block}{tail}"
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    Path(path).write_text(new, encoding="utf-8")


def plot(samples: Mapping[str, Mapping[str, Sequence[float]]], path: str, title: str = "") -> None:
    """Left: RPC latency distributions (box plots, log scale); right: recovery times (ECDFs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6.5), gridspec_kw={"width_ratios": [1.3, 1]})
    rpc = samples.get("RPC latency", {})
    if rpc:
        labels = list(rpc)
        left.boxplot([[v * 1000 for v in rpc[n]] for n in labels], vert=False, whis=(1, 99), showfliers=False)
        left.set_yticks(range(1, len(labels) + 1), labels, fontsize=8)
        left.set_xscale("log")
        left.invert_yaxis()
        left.set_xlabel("ms (box: p25-p75, line: p50, whiskers: p1-p99)")
        left.set_title("RPC latency by mode, concurrent callers and RPC")
        left.grid(axis="x", which="both", alpha=0.3)
    recovery = {  # "Recovery, <setup>" sections: one curve per setup and figure
        f"{section.removeprefix('Recovery, ')}: {name}": values
        for section, figures in samples.items()
        if section.startswith("Recovery")
        for name, values in figures.items()
    }
    for name, values in recovery.items():
        xs = sorted(v * 1000 for v in values)
        right.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{name} (n={len(xs)})")
    if recovery:
        right.set_xlabel("ms")
        right.set_ylabel("fraction of runs done")
        right.set_title("Recovery times (ECDF)")
        right.legend(fontsize=8, loc="lower right")
        right.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
