"""How fast the persistent Viterbi kernel runs with few tiles in flight: the speed/memory trade of its scratch.

Every program of ``exl3tool.kernels.viterbi`` owns one scratch slot (``slot_bytes``: 256 positions x 2^(16-K)
back-pointers, two per byte at K <= 4) and loops over tiles, so GPU memory is ``programs x slot_bytes`` whatever
the batch. This sweep times K = 6 and K = 4 over programs per SM (2 .. the resident wave), warps per program,
edges per block and the ways to keep what the tracebacks need (``--rows 0,1,2``: back-pointers, every step's cost
row with the choice recomputed, or every other row with the odd rows' entries recomputed too; ``--edge-major 0,1``:
the cost-row traceback reading the state-major or the edge-major codebook table), on one batch of fresh Gaussian
tiles, against the baseline in the same run
(the back-pointer kernel with ``programs=None``: as many slots as 2 GiB holds), and checks every variant's states
are the baseline's bit for bit. The exllamav3 reference keeps 4 programs per SM resident (its ``quantize_tiles_scratch``
on an H200), with one byte per back-pointer.

    python benchmarks/bench_viterbi_slots.py --json out.json     # on a CUDA machine, about 3 minutes
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# programs beyond the resident wave run as asked (queued), not capped to it: what a row's programs per SM say
os.environ.setdefault("EXL3TOOL_RESIDENT_CAP", "0")

from exl3tool.kernels import viterbi as vmod  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _viterbi_compiled import last_compiled, record  # noqa: E402

record()


def timed(x: torch.Tensor, bits: int, reps: int = 3, **kw) -> tuple[float, torch.Tensor]:
    """Median seconds of one call over ``x`` (after a warm-up call that also compiles), and its states."""
    _, states = vmod.viterbi_tiles(x, bits, "mcg", **kw)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        vmod.viterbi_tiles(x, bits, "mcg", **kw)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), states


def sweep_sizes(args: argparse.Namespace) -> None:
    """Seconds of one call of N tiles for each program count (and the balanced count: the fewest programs that
    keep the same number of rounds), against programs = N (every tile in flight at once)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    doc = {"gpu": torch.cuda.get_device_name(0), "sms": sms, "rows": []}
    for bits in [int(b) for b in args.bits.split(",")]:
        for n in [int(v) for v in args.sizes.split(",")]:
            x = torch.randn(n, 256, device="cuda") * (0.6 + torch.rand(n, 1, device="cuda"))
            all_s, base = timed(x, bits, programs=n)
            line = [f"K={bits} {n:6} tiles: all at once {all_s * 1e3:6.2f} ms"]
            progs = sorted({int(p) for p in args.programs.split(",") if int(p) < n})
            for p in progs:
                rounds = -(-n // p)
                for label, g in (("", p), ("b", -(-n // rounds))):
                    if label and g == p:
                        continue
                    sec, states = timed(x, bits, programs=g)
                    assert torch.equal(states, base)
                    doc["rows"].append({"bits": bits, "tiles": n, "programs": g, "balanced": bool(label),
                                        "seconds": sec, "all_at_once_s": all_s})
                    line.append(f"{g}{label} {sec * 1e3:.2f}")
            print("; ".join(line), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", type=int, default=32768)
    ap.add_argument("--bits", default="6,4")
    ap.add_argument("--per-sm", default="2,3,4,6,8,12,16")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--rows", default="0,1", help="0: back-pointers, 1: every cost row (the traceback recomputes the choice), "
                    "2: every other cost row")
    ap.add_argument("--edge-major", default="1", help="with cost rows: 0 the traceback reads the state-major codebook "
                    "table, 1 the edge-major one (EXL3TOOL_EDGE_MAJOR_TRACEBACK, docs/tuning.md); 0,1 both")
    ap.add_argument("--edges", default=None, help="edges per block (default 1024,2048 and 4096 at K <= 4)")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--sizes", default=None,
                    help="instead of the sweep: time calls of these many tiles (a small layer's scale-search and "
                         "chunk calls) for each of --programs")
    ap.add_argument("--programs", default="440,528,792,1056,1188,2112,4224")
    args = ap.parse_args()
    if args.sizes:
        return sweep_sizes(args)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    doc = {"gpu": torch.cuda.get_device_name(0), "sms": sms, "tiles": args.tiles, "rows": []}
    print(f"{doc['gpu']}, {sms} SMs, {args.tiles} tiles per call", flush=True)
    for bits in [int(b) for b in args.bits.split(",")]:
        x = torch.randn(args.tiles, 256, device="cuda") * (0.6 + torch.rand(args.tiles, 1, device="cuda"))
        base_s, base_states = timed(x, bits, rows=False)
        wave = vmod.resident_tiles(torch.device("cuda", 0), bits)
        slot = vmod.slot_bytes(bits, rows=False)
        print(f"K={bits}: baseline (back-pointers, programs=None) {args.tiles / base_s:,.0f} tiles/s; resident wave "
              f"{wave}; slot {slot / 1024:.0f} KiB; reference scratch "
              f"{4 * sms * 256 * (1 << (16 - bits)) / 2**20:.0f} MiB", flush=True)
        doc["rows"].append({"bits": bits, "variant": "baseline", "tiles_per_s": args.tiles / base_s,
                            "wave": wave, "slot_bytes": slot})
        edges = [int(e) for e in args.edges.split(",")] if args.edges else [1024, 2048] + ([4096] if bits <= 4 else [])
        for rows in [int(r) for r in args.rows.split(",")]:
            slot = vmod.slot_bytes(bits, rows=rows)
            majors = [bool(int(v)) for v in args.edge_major.split(",")] if rows else [False]
            for warps, be, major, per_sm in itertools.product(
                    [int(w) for w in args.warps.split(",")], edges, majors, [int(p) for p in args.per_sm.split(",")]):
                programs = per_sm * sms
                t0 = time.perf_counter()
                try:
                    sec, states = timed(x, bits, num_warps=warps, block_edges=be, programs=programs, rows=rows,
                                        edge_major=major)
                except Exception as exc:  # a variant that does not compile is reported, not fatal
                    print(f"  rows {rows} warps {warps} edges {be} per-SM {per_sm}: failed "
                          f"{type(exc).__name__}: {exc}"[:200])
                    continue
                occ = vmod._occupancy(last_compiled(), props)
                row = {"bits": bits, "rows": rows, "warps": warps, "block_edges": be, "edge_major": major,
                       "per_sm": per_sm, "programs": programs, "tiles_per_s": args.tiles / sec,
                       "vs_baseline": base_s / sec, "scratch_mib": programs * slot / 2**20, "resident_wave": occ,
                       "same_states": bool(torch.equal(states, base_states))}
                doc["rows"].append(row)
                print(f"  {('bp   ', 'rows ', 'rows2')[rows]}{' em' if major else '   '} warps {warps:2} edges {be:4} "
                      f"per-SM {per_sm:2} ({programs:5} slots, {row['scratch_mib']:6.0f} MiB): "
                      f"{row['tiles_per_s']:9,.0f} tiles/s x{row['vs_baseline']:.2f}  wave {occ}  same "
                      f"{row['same_states']}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
