"""``hookbench capture``: a zoo model's or a workload's activations, captured in one forward
(``ActivationCapture``), printed as a per-module table of statistics."""

from __future__ import annotations

import argparse

import torch

from hookbench.cli import common
from hookbench.mechanisms.activation_capture import ActivationCapture


_COLUMNS = ("mean", "std", "min", "max", "rms", "mean_abs")


def run(args: argparse.Namespace) -> int:
    spec = common.one_workload(args)
    model = spec.build().eval()
    x, _ = spec.data(0)
    with torch.no_grad(), spec.autocast("cpu"), ActivationCapture(
            model, include=args.include or None, exclude=args.exclude or None,
            stats=args.stats) as cap:
        spec.forward(model, x)
    rows = cap.table()
    if not rows:
        raise ValueError("the selected modules produced no output in forward (a module whose "
                         "forward is bypassed, such as nn.MultiheadAttention's out_proj, never "
                         "runs its hooks)")
    width = max(len(f"{r['name']}{'.' + r['path'] if r['path'] else ''}") for r in rows)
    print(f"{spec.name}, batch {spec.batch_size}: {len(rows)} outputs from "
          f"{len({r['name'] for r in rows})} modules ({'statistics' if args.stats else 'tensors'})")
    print(f"{'module':{width}}  call  {'shape':20}  " + "  ".join(f"{s:>10}" for s in _COLUMNS))
    for r in rows:
        name = r["name"] + ("." + r["path"] if r["path"] else "")
        print(f"{name:{width}}  {r['call']:>4}  {str(tuple(r['shape'])):20}  "
              + "  ".join(f"{r[s]:>10.4g}" for s in _COLUMNS))
    return 0
