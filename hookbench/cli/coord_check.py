"""``hookbench coord-check``: the muP coordinate check, a width sweep of each layer's activation
scale with a verdict and a plot, optionally beside microsoft/mup's own (``--peer mup``)."""

from __future__ import annotations

import argparse

from hookbench.cli import common
from hookbench.measure import plot
from hookbench.measure.coord_check import QUANTITIES, coord_check, ratios


def run(args: argparse.Namespace) -> int:
    try:
        widths = tuple(int(w) for w in args.widths.split(","))
    except ValueError:
        raise ValueError(f"--widths must be comma-separated integers, got {args.widths!r}")
    if args.peer and args.parametrization != "mup":
        raise ValueError("--peer mup compares muP with the library's muP; use "
                         "--parametrization mup")
    out = common.output_dir(args.out)
    options = dict(widths=widths, steps=args.steps, seeds=args.seeds, lr=args.lr,
                   readout_zero_init=args.readout_init == "zero")
    if args.peer:
        try:
            from hookbench.measure.peers import microsoft_mup
        except ImportError as e:
            raise ImportError(f"--peer mup needs microsoft/mup (pip install -e '.[mup]'): {e}")
    common.progress(f"training {args.model} ({args.parametrization}) at widths {widths}, "
              f"{args.seeds} seeds, {args.steps} steps ...")
    result = coord_check(args.model, args.parametrization, band=args.band, **options)
    peer = None
    if args.peer:
        common.progress("the same with microsoft/mup (MuReadout, set_base_shapes, MuAdam, "
                  "get_coord_data) ...")
        peer = microsoft_mup.coordinates(args.model, **options)
    rows = [(layer, q, result.coords[layer][q]) for layer in result.coords for q in QUANTITIES]
    if peer is not None:
        rows = [row for layer in result.coords for row in (
            *(r for r in rows if r[0] == layer), (layer, "coord. (mup)", peer[layer]))]
    name = max(len(n) for n in result.coords)
    print(f"{'layer':{name}}  {'':12}  " + "  ".join(f"{f'step {t}':^14}" for t in range(
        result.steps + 1)) + "  (growth/shrinkage across widths; ! out of band)")
    for layer, quantity, table in rows:
        cells = []
        for t, row in enumerate(table):
            if quantity == "change" and t == 0:
                cells.append(f"{'-':^14}")
                continue
            up, down = ratios(row)
            mark = "!" if max(up, down) > result.band else " "
            cells.append(f"{up:6.2f}/{down:<6.2f}{mark}")
        print(f"{layer:{name}}  {quantity:12}  " + "  ".join(cells))
    png = plot.coord_check(result, out / f"coord-check-{args.model}-"
                                                    f"{args.parametrization}.png")
    print(f"\n{result.verdict()}")
    if peer is not None:
        print(f"hookbench vs microsoft/mup: coordinates differ by at most "
              f"{microsoft_mup.difference(result, peer):.2g} (relative)")
    print(f"wrote {png}")
    return 0 if result.passed else 1
