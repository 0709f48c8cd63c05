"""Terminal rendering of plans for the command line: summary, per-device load, heatmap.

Everything here works on a *report*: a plain, JSON-ready dictionary built by
:func:`plan_report` from a plan's pieces and statistics. The command line prints
reports, ``--json`` dumps them, and a multi-process demo sends them from its worker
processes back to the launcher: one form serves all three.

Transfer matrices of thousands of devices do not fit a terminal (and would not fit
memory as a dense ``int64`` matrix either), so the report holds the matrix already
aggregated into at most ``max_blocks`` blocks per side: consecutive device ids (in
sorted order) share a block. With few devices every block is one device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._geometry import volume
from ._mesh_surgery import device_ranges as device_ranges
from ._plan import human_bytes
from ._planner import LeafPlan, PlanStats

# Per-device tables list every device up to this many; beyond, a distribution.
MAX_DEVICE_ROWS = 16
# Heatmap intensity: level 0 is "nothing moves", then quarters of the largest cell.
_SHADES = ("·", "░", "▒", "▓", "█")
_ASCII_SHADES = (".", ":", "+", "#", "@")
_COLOURS = ("grey35", "#3b528b", "#21918c", "#5ec962", "#fde725")  # viridis, dark to light


def _blocks(ids: Sequence[int], max_blocks: int) -> list[list[int]]:
    size = max(1, math.ceil(len(ids) / max_blocks))
    return [list(ids[i : i + size]) for i in range(0, len(ids), size)]


def block_matrix(leaf_plans: Sequence[LeafPlan], max_blocks: int) -> dict[str, Any]:
    """The transfer matrix (bytes from source to destination device), in blocks.

    Args:
      leaf_plans: the planner's result for every array of a plan.
      max_blocks: at most this many blocks per side.

    Returns:
      ``{"src_blocks": [[ids...], ...], "dst_blocks": [...], "bytes": [[...]]}`` where
      ``bytes[i][j]`` is what the devices of source block ``i`` send to the devices of
      destination block ``j``. Source rows cover every device holding a source shard,
      columns every device holding a destination shard.
    """
    src_ids = sorted({s.device for lp in leaf_plans for s in lp.spec.src})
    dst_ids = sorted({s.device for lp in leaf_plans for s in lp.spec.dst})
    src_blocks, dst_blocks = _blocks(src_ids, max_blocks), _blocks(dst_ids, max_blocks)
    src_size = len(src_blocks[0]) if src_blocks else 1
    dst_size = len(dst_blocks[0]) if dst_blocks else 1
    senders, receivers, nbytes = [], [], []
    for lp in leaf_plans:
        spec = lp.spec
        for p in lp.moved:
            senders.append(spec.src[p.src].device)
            receivers.append(spec.dst[p.dst].device)
            nbytes.append(volume(p.box) * spec.itemsize)
    m = np.zeros((len(src_blocks), len(dst_blocks)), dtype=np.int64)
    if not nbytes:
        return {"src_blocks": src_blocks, "dst_blocks": dst_blocks, "bytes": m.tolist()}
    # Vectorised: a plan for thousands of devices has hundreds of thousands of pieces.
    rows = np.searchsorted(src_ids, senders) // src_size
    cols = np.searchsorted(dst_ids, receivers) // dst_size
    if sum(nbytes) <= np.iinfo(np.int64).max:
        np.add.at(m, (rows, cols), np.asarray(nbytes, dtype=np.int64))
        return {"src_blocks": src_blocks, "dst_blocks": dst_blocks, "bytes": m.tolist()}
    # Arrays of exabytes (a synthetic plan allows them): cells beyond int64, in Python ints.
    cells = [[0] * len(dst_blocks) for _ in src_blocks]
    for r, c, b in zip(rows.tolist(), cols.tolist(), nbytes, strict=True):
        cells[r][c] += b
    return {"src_blocks": src_blocks, "dst_blocks": dst_blocks, "bytes": cells}


def plan_report(
    leaf_plans: Sequence[LeafPlan], stats: PlanStats, *, max_blocks: int = 32
) -> dict[str, Any]:
    """The JSON-ready report of a plan: its statistics and its blocked transfer matrix."""
    return {
        "arrays": len(leaf_plans),
        "stats": stats.as_dict(),
        "matrix": block_matrix(leaf_plans, max_blocks),
    }


# ----------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------


def _ids(d: Mapping[str, int]) -> dict[int, int]:
    return {int(k): int(v) for k, v in d.items()}


def summary_table(report: Mapping[str, Any], title: str = "plan") -> Table:
    """Bytes moved against the lower bound, transfers, kept bytes and per-device peaks."""
    s = report["stats"]
    moved, lower = s["bytes_moved"], s["bytes_lower_bound"]
    t = Table.grid(padding=(0, 2))
    t.title, t.title_justify = title, "left"
    t.add_column(style="bold")
    t.add_column()
    t.add_row("arrays", f"{report['arrays']:,} ({human_bytes(s['array_bytes'])} logical)")
    t.add_row("destination", f"{human_bytes(s['bytes_total'])} in all destination shards")
    verdict = (
        Text("= the lower bound: optimal", style="green")
        if moved == lower
        else Text(f"ABOVE the lower bound {human_bytes(lower)} ({lower:,} B)", style="bold red")
    )
    t.add_row("moved", Text.assemble(f"{human_bytes(moved)} ({moved:,} B) ", verdict))
    t.add_row("kept in place", human_bytes(s["bytes_kept"]))
    t.add_row("transfers", f"{s['transfers']:,}")
    senders = sum(1 for v in s["send_bytes"].values() if v)
    t.add_row(
        "send/device",
        f"max {human_bytes(s['max_send_bytes'])}, mean {human_bytes(s['mean_send_bytes'])} "
        f"over {senders:,} sender(s)",
    )
    t.add_row("peak extra", f"max {human_bytes(s['max_peak_extra_bytes'])} on one device")
    return t


def device_table(report: Mapping[str, Any]) -> Table | Text:
    """Per-device send/receive bytes; a min/mean/max distribution for many devices."""
    s = report["stats"]
    send, recv, peak = _ids(s["send_bytes"]), _ids(s["recv_bytes"]), _ids(s["peak_extra_bytes"])
    devices = sorted(set(send) | set(recv) | set(peak))
    if not any((*send.values(), *recv.values(), *peak.values())):
        # (Zero-size arrays, or nothing to move: a table of zeros, or of headers alone.)
        return Text("per device: no device sends, receives or allocates anything")
    if len(devices) <= MAX_DEVICE_ROWS:
        t = Table(title="per device", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
        for name in ("device", "sends", "receives", "new buffers"):
            t.add_column(name, justify="right")
        for d in devices:
            t.add_row(
                str(d),
                human_bytes(send.get(d, 0)),
                human_bytes(recv.get(d, 0)),
                human_bytes(peak.get(d, 0)),
            )
        return t
    t = Table(
        title=f"per device ({len(devices):,} devices)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    for name in ("", "devices", "min", "mean", "max", "busiest"):
        t.add_column(name, justify="right")
    for name, values in (("sends", send), ("receives", recv), ("new buffers", peak)):
        active = {d: v for d, v in values.items() if v}
        if not active:
            t.add_row(name, "0", "-", "-", "-", "-")
            continue
        busiest = max(active, key=lambda d: (active[d], -d))
        t.add_row(
            name,
            str(len(active)),
            human_bytes(min(active.values())),
            human_bytes(sum(active.values()) / len(active)),
            human_bytes(active[busiest]),
            f"device {busiest}",
        )
    return t


def _block_label(ids: Sequence[int]) -> str:
    """A block's ids as ``reshard plan`` writes device lists (``0-3,100-101``), or, where
    that is long, ``first..last``: not the range syntax, since ids are missing."""
    label = device_ranges(ids)
    return label if len(label) <= 16 else f"{ids[0]}..{ids[-1]}"


def heatmap(report: Mapping[str, Any], *, ascii_only: bool = False) -> Text:
    """The transfer matrix as a block-character heatmap: rows send, columns receive."""
    mat = report["matrix"]
    m: list[list[int]] = mat["bytes"]  # Python ints: cells may exceed int64
    out = Text()
    peak = max((max(row, default=0) for row in m), default=0)
    if peak == 0:
        out.append("transfer matrix: nothing moves (every destination byte is already in place)")
        return out
    shades = _ASCII_SHADES if ascii_only else _SHADES
    src_blocks, dst_blocks = mat["src_blocks"], mat["dst_blocks"]
    single = all(len(b) == 1 for b in dst_blocks)
    # One device per column: wide enough for its id, so the header can name it.
    width = max(2, *(len(str(b[0])) + 1 for b in dst_blocks)) if single else 2
    labels = [_block_label(b) for b in src_blocks]
    pad = max(len(x) for x in labels + ["src\\dst"])
    grouped = any(len(b) > 1 for b in src_blocks + dst_blocks)
    what = "transfer matrix (bytes sent, source device rows x destination device columns"
    out.append(what + (",\ngrouped into blocks of devices in id order)\n" if grouped else ")\n"))
    if any(".." in label for label in labels):  # (column blocks are not labelled)
        out.append("(a..b: a block from device a to device b, with gaps)\n")
    if single:
        out.append("src\\dst".rjust(pad) + " ")
        out.append("".join(str(b[0]).rjust(width) for b in dst_blocks) + "\n", style="bold")
    else:
        out.append(
            f"{'':>{pad}} columns: destination devices "
            f"{device_ranges(sorted(i for b in dst_blocks for i in b))} "
            f"in {len(dst_blocks)} block(s) of up to {len(dst_blocks[0])}\n"
        )
    for label, row in zip(labels, m, strict=True):
        out.append(label.rjust(pad) + " ", style="bold")
        for v in row:
            level = 0 if v == 0 else max(1, -(-4 * v // peak))  # ceil, exact
            out.append((shades[level] * 2).rjust(width), style=_COLOURS[level])
        out.append("\n")
    out.append(f"{'':>{pad}} ")
    for level in range(5):
        out.append(shades[level], style=_COLOURS[level])
        out.append(" 0  " if level == 0 else f" {25 * level}%  ")
    out.append(f"of the largest cell ({human_bytes(peak)})")
    return out


def render_report(console: Console, report: Mapping[str, Any], *, title: str = "plan") -> None:
    """Prints a report: summary, per-device load and the heatmap."""
    console.print(summary_table(report, title))
    console.print()
    console.print(device_table(report))
    # One line per source block, however narrow the terminal (or 80 columns, piped):
    # a wrapped row no longer lines up with the header's device ids.
    console.print(
        heatmap(report, ascii_only=console.options.ascii_only),
        no_wrap=True,
        overflow="ignore",
        crop=False,
    )
